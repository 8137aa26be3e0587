"""The command line of ``python -m overlay.apply`` (also ``python -m overlay``, ``attn-overlay``).

Parsing, dispatch and the text it prints. The report is built by :mod:`overlay.install_check`
(whose child program, run in a fresh process, is :mod:`overlay._verify_child`); the bug-report
block by :mod:`overlay.environment`.

``--json`` prints one document whose top-level keys are the same in every case (schema 1):

``schema``            1
``overlay_version``   this package's version
``python``            the interpreter's version
``transformers_version``  the installed release, or null
``hook``              ``{"active": true|false|null, "verified": bool, "reason": str|null}``: whether the
                      startup hook activates the overlay in a fresh process of this interpreter
                      (null: not checked, ``--no-verify`` or transformers not installed), and why not
                      (where null: why it was not checked)
``patches``           one object per patch: ``id, title, state, reason, module, transformers_version,
                      affected, fixed_in, variants, changes`` (what the fix changes where it applies:
                      ``"errors"``, only calls that raise on stock; ``"output"``, calls that complete on
                      stock give the fixed release's tokens or scores; ``"both"``) and ``would_be``
                      (the state the patch would reach if the hook were active; null when it is active,
                      and with ``--no-verify``, whose states are those the patches reach in the
                      reporting process itself, the overlay activated there as the fresh process would)
``import_errors``     target modules that failed to import in the verification process (``--no-verify``:
                      in the reporting process)
``settings``          one object per setting of ``overlay/config.py``'s table, keyed by its environment
                      variable, in table order: ``value`` (the value in force: a bool, a string, a
                      list of patch ids, or null for a default location), ``source``
                      (``"environment"`` or ``"default"``), ``raw`` (the environment's text, or null),
                      ``default`` (as a user writes it), ``problem`` (why the environment's value is
                      not used, or null) and ``deprecated`` (a deprecated name's note, or null)
``summary``           one line for the whole release when every patch says the same of it (a release
                      older than every patch's range), or null
``ok``                what the exit status says: no patch failed, met unrecognised code or was
                      displaced (and, in strict mode, the hook is active and no setting has a problem)

``--env`` (``attn-overlay env``) prints another document, the bug-report block: one object of
``key: text`` in the order of the text block (``overlay/environment.py``).

``--compare PROGRAM [ARGS]`` (or ``--compare -m MODULE [ARGS]``) runs the program twice, each in a
fresh process of this interpreter: stock (``ATTN_OVERLAY=0``, so the startup hook, where installed,
leaves transformers alone) and with the overlay (``python -m overlay.apply PROGRAM``), and compares
what the program printed on stdout and its exit status. It prints which patches fired in the overlay
run (``overlay.fired()``) and exits 0 where the two runs are identical, 1 where they differ (naming
what fired), 2 where it could not compare (the program could not be started, the overlay run did not
report, a run timed out: the reason is printed). Both runs get the same environment otherwise, so a
program that is not deterministic by itself (unseeded sampling, timings) differs by itself: seed it.
Its stderr (warnings, progress bars) is shown on a difference, never compared.

Within one schema number keys are only ever added (``settings`` and ``summary`` were added within
schema 1, and each patch's ``changes``); a key
removed or given another meaning raises the number.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from collections.abc import Sequence
from typing import Any

from . import config, engine, environment
from ._version import __version__

# What the startup hook does here is a fact of the environment (the bug-report block says it too);
# the tests read it as cli.why_the_hook_is_inactive.
from .environment import why_the_hook_is_inactive

# The report and the hook's check live in install_check; their names stay readable here.
from .install_check import HOOK_NOT_CHECKED, SCHEMA, build_report, interpreter_flags, setting_problems
from .patch import CHANGES_ERRORS

__all__ = [
    "COMPARE_COULD_NOT", "COMPARE_DIFFERENT", "COMPARE_IDENTICAL", "FIRED_FILE_VAR", "SCHEMA", "build_report", "compare",
    "interpreter_flags", "main", "print_environment", "report", "run_program",
    "setting_problems", "why_the_hook_is_inactive",
]

USAGE = """\
python -m overlay.apply [--json] [--strict] [--no-verify]
python -m overlay.apply [--strict] PROGRAM.py [ARGS...]
python -m overlay.apply [--strict] -m MODULE [ARGS...]
python -m overlay.apply --compare PROGRAM.py [ARGS...]
python -m overlay.apply --compare -m MODULE [ARGS...]
python -m overlay.apply --env [--json]    (also: attn-overlay env [--json])"""

#: The console script's subcommand for ``--env``: ``attn-overlay env``. Only there: ``python -m
#: overlay.apply env`` runs a program named env, as ``python env`` would.
ENV_SUBCOMMAND = "env"
CONSOLE_SCRIPT = "attn-overlay"

DESCRIPTION = """\
Without a program: show every patch with its status for the installed transformers, and verify
in a fresh subprocess (same interpreter, same flags) that the startup hook really activates the
overlay there, and show the settings in force. With a program or -m MODULE: run it with the
patches applied (for environments where startup hooks are not processed, e.g. `python -S`,
embedded interpreters, or ATTN_OVERLAY=0); its child processes (multiprocessing spawn and
forkserver children included) get them too wherever the startup hook is installed. With --compare
and a program: run it stock and with the overlay, each in a fresh process, and say whether its
stdout and exit status differ and which patches fired (exit 0: identical, 1: different, 2: could
not compare). ATTN_OVERLAY_FIXES=errors keeps only the fixes that change nothing but calls that
raise on stock (the table's `changes` column says what each fix changes)."""

#: How the report's reason begins where a module shadows the overlay (``environment.shadow_reason``).
_SHADOWED_REASON = "`import overlay` finds "


def _parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m overlay.apply", usage=USAGE, description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"attn-overlay {__version__}")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (schema: see overlay/cli.py)")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="exit non-zero (report) or raise (program) when a patch meets unrecognised code or "
        "fails; the report also when the hook is inactive or a setting is outside the table "
        "(overlay/config.py); same as ATTN_OVERLAY_STRICT=1",
    )
    parser.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the fresh-subprocess check of the startup hook (reported as not checked); the "
        "patches are judged in this process instead, with the overlay activated here",
    )
    parser.add_argument(
        "--env",
        action="store_true",
        help="print the block to paste into a bug report (versions, accelerator, hook, patches, changed "
        "settings; no model runs); with --json, the same keys as one object. `attn-overlay env` is the same",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="run the program (or -m MODULE) twice in fresh processes, stock and with the overlay, and "
        "compare its stdout and exit status; prints which patches fired. Exit 0: identical, 1: they "
        "differ, 2: the comparison could not run (the reason is printed)",
    )
    parser.add_argument("-m", dest="module", metavar="MODULE", help="run library module as a script")
    # Everything from the program (or -m's module) on belongs to the program.
    options: list[str] = []
    rest: list[str] = list(argv)
    while rest and rest[0].startswith("-") and rest[0] != "-m":
        options.append(rest.pop(0))
    if rest and rest[0] == "-m":
        if len(rest) < 2:
            parser.error("-m needs a module name")
        options += rest[:2]
        rest = rest[2:]
    args = parser.parse_args(options)
    if args.env and (args.module or rest):
        parser.error("--env runs nothing: leave out the program (or -m MODULE)")
    if args.compare and not (args.module or rest):
        parser.error("--compare needs a program: --compare PROGRAM.py [ARGS...] or --compare -m MODULE [ARGS...]")
    if args.compare and (args.env or args.json):
        parser.error("--compare prints its own verdict: leave out --env and --json")
    return args, rest


def _settings_table(settings: dict[str, Any]) -> str:
    rows = []
    for name, entry in settings.items():
        value = entry["value"]
        if isinstance(value, bool):
            shown = "1" if value else "0"
        elif isinstance(value, list):
            shown = ",".join(value) if value else "none"
        else:
            shown = "default location" if value is None else str(value)
        if entry["source"] != config.FROM_ENVIRONMENT:
            source = "default"
        else:
            source = "from the environment" + (": not accepted, see below" if entry["problem"] else "")
        rows.append((name, shown, source))
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    lines = ["settings (overlay/config.py has the table):"]
    lines += [f"  {name:<{widths[0]}}  {shown:<{widths[1]}}  {source}" for name, shown, source in rows]
    for entry in settings.values():
        for message in (entry["problem"], entry["deprecated"]):
            if message:
                lines.append("  " + message.removeprefix("attn-overlay: "))
    return "\n".join(lines)


def _table(rows: list[dict[str, Any]]) -> str:
    # "changes": what the fix changes where it applies (errors / output / both: Patch.changes);
    # a row from an older verification child may lack it.
    headers = ("patch", "status", "changes", "why")
    body = [
        (
            r["id"],
            r["state"] if not r.get("would_be") else f"{r['state']} (would be: {r['would_be']})",
            r.get("changes") or "?",
            r["reason"],
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(headers[:3])]
    lines = [f"{headers[0]:<{widths[0]}}  {headers[1]:<{widths[1]}}  {headers[2]:<{widths[2]}}  {headers[3]}"]
    lines.append(f"{'-' * widths[0]}  {'-' * widths[1]}  {'-' * widths[2]}  {'-' * 3}")
    for pid, state, changes, why in body:
        lines.append(f"{pid:<{widths[0]}}  {state:<{widths[1]}}  {changes:<{widths[2]}}  {why}")
    lines.append(
        "changes: errors = only calls that raise on stock; output = calls that complete on stock give other "
        f"tokens or scores (the fixed release's); both. {config.FIXES_VAR}=errors keeps only the first"
    )
    return "\n".join(lines)


def report(args: argparse.Namespace) -> int:
    result = build_report(verify=not args.no_verify)
    strict = args.strict or config.strict_from_env()
    hook = result["hook"]
    if strict and (hook["active"] is False or setting_problems(result)):
        result["ok"] = False
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        version = result["transformers_version"]
        print(f"attn-overlay {__version__} | transformers {version or 'not installed'} | python {result['python']}")
        print(_table(result["patches"]))
        if result["summary"]:
            print(f"\n{result['summary']}")
        if hook["active"] is True:
            print("\nstartup hook: active (verified in a fresh subprocess with this interpreter's flags)")
        elif hook["active"] is False:
            print(f"\nstartup hook: NOT active: {hook['reason']}")
            if str(hook["reason"]).startswith(_SHADOWED_REASON):  # neither way around it works there
                print("  No program started here gets these patches; the status column says what they would reach.")
            else:
                print(
                    "  No program gets these patches until then, except through `python -m overlay.apply PROGRAM.py`"
                    " or `overlay.apply()`; the status column says what they would reach."
                )
        elif hook["reason"] == HOOK_NOT_CHECKED:
            print(f"\nstartup hook: {hook['reason']}")
        elif hook["reason"]:
            print(f"\n{hook['reason']}")
        print("\n" + _settings_table(result["settings"]))
        if strict and setting_problems(result):
            print("  (strict mode: a setting outside the table fails the check)")
    return 0 if result["ok"] else 1


def run_program(args: argparse.Namespace, rest: list[str]) -> int:
    """Run the program (or ``-m`` module) with the patches applied, in this process; its child
    processes get them through the startup hook (see :func:`_hand_down_to_children`)."""
    engine.apply(strict=True if args.strict else None)
    in_force = engine.settings()
    assert in_force is not None  # apply() has just activated the overlay
    _hand_down_to_children(strict=in_force.strict)
    _write_fired_at_exit()
    if args.module:
        cannot = _cannot_run_module(args.module)
        if cannot is not None:  # what `python -m MODULE` prints, and its exit status
            print(f"{sys.executable}: {cannot}", file=sys.stderr)
            return 1
        sys.argv = [args.module, *rest]
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        return 0
    program, *program_args = rest
    cannot_open = _cannot_run_path(program)
    if cannot_open is not None:  # what `python PROGRAM` prints, and its exit status
        message, status = cannot_open
        print(f"{sys.executable}: {message}", file=sys.stderr)
        return status
    sys.argv = [program, *program_args]
    if not os.path.isdir(program):  # run_path puts a folder (or zip) itself first on sys.path
        sys.path.insert(0, os.path.dirname(os.path.abspath(program)))
    runpy.run_path(program, run_name="__main__")
    return 0


#: Where ``--compare``'s overlay run writes what fired and what was applied: the comparison's own
#: channel, so that the program's stdout and stderr stay the program's. Internal: read and removed
#: by :func:`run_program` (the program's own children do not inherit it).
FIRED_FILE_VAR = "_ATTN_OVERLAY_COMPARE_FIRED"

#: ``--compare``'s exit statuses.
COMPARE_IDENTICAL, COMPARE_DIFFERENT, COMPARE_COULD_NOT = 0, 1, 2


def _write_fired_at_exit() -> None:
    """In ``--compare``'s overlay run: at exit, write ``overlay.fired()`` and the patches' states
    to the file :data:`FIRED_FILE_VAR` names (nothing without it). Never raises."""
    path = os.environ.pop(FIRED_FILE_VAR, None)
    if not path:
        return
    import atexit

    def write() -> None:
        from . import report as fired_report

        try:
            document = {
                "fired": fired_report.fired(),
                "patches": {s.id: {"state": s.state, "changes": s.changes} for s in engine.status()},
            }
            with open(path, "w", encoding="utf-8") as f:
                json.dump(document, f)
        except Exception:  # the program's exit is the program's: the comparison says what is missing
            pass

    atexit.register(write)


def _child_environment() -> dict[str, str]:
    """The environment both ``--compare`` runs start from: this one, with this very overlay package
    importable (a plain checkout found through the working directory or PYTHONPATH, as the doctor
    does); an overlay in site-packages is found there anyway."""
    import site

    env = dict(os.environ)
    env.pop(FIRED_FILE_VAR, None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    site_folders = {os.path.abspath(p) for p in site.getsitepackages() + [site.getusersitepackages()]}
    if root not in site_folders:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _first_difference(stock: str, ours: str) -> str:
    """Where two outputs first differ, as two quoted lines."""
    a, b = stock.splitlines(), ours.splitlines()
    for number, (left, right) in enumerate(zip(a, b, strict=False), start=1):
        if left != right:
            return f"line {number}:\n  stock:   {left!r}\n  overlay: {right!r}"
    shorter, longer, which = (a, b, "overlay") if len(a) < len(b) else (b, a, "stock")
    if len(a) != len(b):
        return f"line {len(shorter) + 1}: only the {which} run prints it: {longer[len(shorter)]!r}"
    return "only in line endings or a trailing newline"


def compare(args: argparse.Namespace, rest: list[str]) -> int:
    """``--compare``: the program stock and with the overlay, each in a fresh process of this
    interpreter (same flags); 0 identical stdout and exit status, 1 different, 2 could not compare
    (see the module docstring)."""
    import subprocess
    import tempfile

    from .install_check import interpreter_flags as flags_of_this_interpreter

    if args.module:
        cannot = _cannot_run_module(args.module)
        target = ["-m", args.module, *rest]
    else:
        cannot_open = _cannot_run_path(rest[0])
        cannot = None if cannot_open is None else cannot_open[0]
        target = list(rest)
    shown = " ".join(target)
    if cannot is not None:
        print(f"attn-overlay --compare: could not compare: {cannot}", file=sys.stderr)
        return COMPARE_COULD_NOT
    python = [sys.executable, *flags_of_this_interpreter()]
    env = _child_environment()
    # The overlay run imports this package: check first that a fresh process finds this one, or
    # a difference would only say that the overlay run could not start.
    here = os.path.dirname(os.path.abspath(__file__))
    probe = subprocess.run(
        [*python, "-c", "import os, overlay; print(os.path.abspath(overlay.__file__))"],
        env=env, capture_output=True, text=True,
    )
    found = probe.stdout.strip().splitlines()[-1:] if probe.returncode == 0 else []
    if not found or os.path.realpath(os.path.dirname(found[0])) != os.path.realpath(here):
        why = f"it finds {found[0]}" if found else (probe.stderr.strip().splitlines() or ["no output"])[-1]
        print(
            f"attn-overlay --compare: could not compare: a fresh process of {sys.executable} does not import "
            f"this overlay ({here}): {why}",
            file=sys.stderr,
        )
        return COMPARE_COULD_NOT
    strict = ["--strict"] if args.strict else []
    with tempfile.TemporaryDirectory(prefix="attn-overlay-compare-") as scratch:
        fired_path = os.path.join(scratch, "fired.json")
        runs = {}
        for name, command, extra in (
            # Stock: ATTN_OVERLAY=0 turns the startup hook off in the process and its children.
            ("stock", [*python, *target], {config.ENABLE_VAR: "0"}),
            ("overlay", [*python, "-m", "overlay.apply", *strict, *target], {FIRED_FILE_VAR: fired_path}),
        ):
            try:
                runs[name] = subprocess.run(command, env={**env, **extra}, capture_output=True)
            except (OSError, KeyboardInterrupt) as exc:
                print(f"attn-overlay --compare: could not compare: the {name} run did not run: {exc}", file=sys.stderr)
                return COMPARE_COULD_NOT
        try:
            with open(fired_path, encoding="utf-8") as f:
                reported: dict[str, Any] | None = json.load(f)
        except (OSError, ValueError):
            reported = None
    stock, ours = runs["stock"], runs["overlay"]
    print(f"attn-overlay --compare: {shown}")
    print(f"  stock (ATTN_OVERLAY=0): exit status {stock.returncode}, {len(stock.stdout)} bytes on stdout")
    print(f"  with the overlay:       exit status {ours.returncode}, {len(ours.stdout)} bytes on stdout")
    fired_ids: list[str] = []
    if reported is None:
        print(
            "  what fired: unknown: the overlay run ended without reporting it (killed by a signal, "
            "os._exit, or it failed before its program started: see its stderr below)"
        )
    else:
        fired = reported.get("fired", {})
        fired_ids = sorted(fired)
        patches = reported.get("patches", {})
        applied = [pid for pid, entry in patches.items() if entry.get("state") == engine.APPLIED]
        print(f"  applied in the overlay run: {len(applied)} patch(es)" + (f" ({config.FIXES_VAR}={config.fixes()})"
              if config.fixes() != config.FIXES_ALL else ""))
        if fired_ids:
            print("  fired: " + ", ".join(
                f"{pid} ({fired[pid]} call(s); changes {patches.get(pid, {}).get('changes', '?')})" for pid in fired_ids
            ))
        else:
            print("  fired: none (no patch changed anything in this run)")
    differences = []
    if stock.returncode != ours.returncode:
        differences.append(f"exit status {stock.returncode} stock, {ours.returncode} with the overlay")
    if stock.stdout != ours.stdout:
        differences.append(
            "stdout differs at " + _first_difference(stock.stdout.decode(errors="replace"), ours.stdout.decode(errors="replace"))
        )
    if not differences:
        print("identical: the same stdout and exit status" + (
            f" (though {', '.join(fired_ids)} fired: what they changed did not reach the output)" if fired_ids else ""
        ))
        return COMPARE_IDENTICAL
    print("DIFFERENT: " + "; ".join(differences))
    if fired_ids:
        kinds = {(reported or {}).get("patches", {}).get(pid, {}).get("changes") for pid in fired_ids}
        print(f"  what fired: {', '.join(fired_ids)} (python -m overlay.apply shows what each patch fixes; "
              f"{config.DISABLE_VAR}=<id> leaves one out)")
        if kinds == {CHANGES_ERRORS}:
            print("  each of them changes only calls that raise on stock: the difference is a call stock failed")
        elif config.fixes() == config.FIXES_ALL:
            print(f"  {config.FIXES_VAR}=errors keeps only the fixes of calls that raise on stock")
    else:
        print("  no patch fired: the program differs by itself (unseeded randomness, timings, the environment)?")
    for name, run in runs.items():
        tail = run.stderr.decode(errors="replace").strip().splitlines()[-5:]
        if tail and run.returncode != 0:
            print(f"  {name} run's stderr ends:")
            print("\n".join(f"    {line}" for line in tail))
    return COMPARE_DIFFERENT


def _hand_down_to_children(strict: bool) -> None:
    """Turn the startup hook on for the program's child processes, whatever ``ATTN_OVERLAY`` says.

    A ``multiprocessing`` (or ``torch.multiprocessing``) child started by spawn or forkserver is a
    fresh interpreter: it re-imports the program's main module and gets nothing of this process's
    patches. Where the startup hook is installed, ``ATTN_OVERLAY=1`` (and ``ATTN_OVERLAY_STRICT=1``
    in strict mode) in the environment they inherit makes it activate the overlay there too, as in
    this process. Where it is not (``-S``, an editable install, ``pip install --target``), the
    children run unpatched: they must call ``overlay.apply()`` themselves (README, "The switches").
    Forked children inherit this process's patches as they are.
    """
    os.environ[config.ENABLE_VAR] = "1"
    if strict:
        os.environ[config.STRICT_VAR] = "1"


def _cannot_run_module(name: str) -> str | None:
    """Python's own message when ``python -m name`` cannot run ``name`` (no such module, a package
    without ``__main__``, ...), else ``None``. Resolves the module as ``python -m`` does (importing
    its parent packages), without running it."""
    details = getattr(runpy, "_get_module_details", None)  # what `python -m` itself calls
    if details is None:  # not this Python's runpy: run_module raises the same ImportError
        return None

    class CannotRun(Exception):
        pass

    try:
        details(name, CannotRun)
    except CannotRun as exc:
        return str(exc)
    return None


def _cannot_run_path(program: str) -> tuple[str, int] | None:
    """Python's own message and exit status when ``python program`` cannot run it, else ``None``."""
    where = os.path.abspath(program)
    if os.path.isdir(program):
        if not any(os.path.isfile(os.path.join(program, name)) for name in ("__main__.py", "__main__.pyc")):
            return f"can't find '__main__' module in {where!r}", 1
        return None
    try:
        with open(program, "rb"):
            pass
    except OSError as exc:
        return f"can't open file {where!r}: [Errno {exc.errno}] {exc.strerror}", 2
    return None


def print_environment(as_json: bool) -> int:
    """``--env``: the bug-report block (:mod:`overlay.environment`)."""
    lines = environment.collect()
    print(json.dumps(lines, indent=2) if as_json else environment.format_block(lines))
    return 0


def _started_as_console_script() -> bool:
    # pip's launcher runs `attn-overlay` with that path as argv[0] (".exe" removed on Windows);
    # `python -m overlay.apply` gives the module's file.
    name = os.path.basename(sys.argv[0]) if sys.argv else ""
    return name == CONSOLE_SCRIPT or name.startswith(CONSOLE_SCRIPT + "-script.")


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
        if argv[:1] == [ENV_SUBCOMMAND] and _started_as_console_script():
            argv = ["--env", *argv[1:]]
    args, rest = _parse(argv)
    if args.compare:
        return compare(args, rest)
    if args.module or rest:
        return run_program(args, rest)
    try:
        if args.env:
            return print_environment(args.json)
        return report(args)
    except BrokenPipeError:
        # Piped into `head`: the reader left. Point stdout at devnull so the interpreter's own
        # flush at exit does not raise again (the pattern the Python docs give for SIGPIPE).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
