"""The command line of ``python -m overlay.apply`` (also ``python -m overlay``, ``attn-overlay``).

``--json`` prints one document whose top-level keys are the same in every case (schema 1):

``schema``            1
``overlay_version``   this package's version
``python``            the interpreter's version
``transformers_version``  the installed release, or null
``hook``              ``{"active": true|false|null, "verified": bool, "reason": str|null}``: whether the
                      startup hook activates the overlay in a fresh process of this interpreter
                      (null: not checked, ``--no-verify`` or transformers not installed), and why not
``patches``           one object per patch: ``id, title, state, reason, module, transformers_version,
                      affected, fixed_in, variants`` and ``would_be`` (the state the patch would reach
                      if the hook were active; null when it is active)
``import_errors``     target modules that failed to import in the verification process
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

Within one schema number keys are only ever added (``settings`` and ``summary`` were added within
schema 1); a key
removed or given another meaning raises the number.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
from collections.abc import Sequence

from . import config, engine, environment
from ._version import __version__

# What the startup hook does here is a fact of the environment (the bug-report block says it too);
# pytest_plugin and the tests read it as cli.why_the_hook_is_inactive.
from .environment import why_the_hook_is_inactive

SCHEMA = 1

USAGE = """\
python -m overlay.apply [--json] [--strict] [--no-verify]
python -m overlay.apply [--strict] PROGRAM.py [ARGS...]
python -m overlay.apply [--strict] -m MODULE [ARGS...]
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
forkserver children included) get them too wherever the startup hook is installed."""

# Imports the patch target modules the way a user program started here would, then reports what
# happened. It never calls overlay.apply() before reading hook_active: whatever is active there was
# activated by the startup hook. PACKAGE_ROOT is the folder holding the caller's overlay package.
_VERIFY_CODE = """
import importlib, json, logging, sys
# Last on the path: used only where this process finds no overlay of its own (-S, -I, -P).
sys.path.append(PACKAGE_ROOT)
# Whether the startup hook ran at interpreter start: its .pth line (or .start file) imports this
# module. Importing it here would install the hook, so where the start did not, it is read switched
# off: the check must not activate what it checks (an editable install has no .pth, yet the module
# is importable).
hook_ran = "_attn_overlay_startup" in sys.modules
try:
    if not hook_ran:
        import os
        switch = os.environ.get("ATTN_OVERLAY")
        os.environ["ATTN_OVERLAY"] = "0"
    try:
        import _attn_overlay_startup as startup
    finally:
        if not hook_ran:
            if switch is None:
                del os.environ["ATTN_OVERLAY"]
            else:
                os.environ["ATTN_OVERLAY"] = switch
    shadowed = startup.shadowing_module()
except (ImportError, AttributeError):
    startup = shadowed = None
if shadowed:
    # A program started here imports the user's module, not the overlay (the hook refuses and
    # says so). Still show what the patches would reach, with the caller's overlay, explicitly.
    hooks = startup.finder()
    if hooks is not None:
        hooks.unwatch("transformers", startup.activate_when_transformers_is_imported)
    sys.path.insert(0, PACKAGE_ROOT)
import overlay.engine as engine
modules = sorted({p.module for p in engine.known_patches()})
errors = {}
for name in modules:
    try:
        importlib.import_module(name)
    except Exception as exc:
        errors[name] = f"{type(exc).__name__}: {exc}"
hook_active = hook_ran and engine.is_active()
if not hook_active:
    # Still show what the patches would reach here: the same gate on the same code, applied
    # explicitly (the modules are imported already, so the late-import warning is silenced).
    logging.getLogger("overlay").setLevel(logging.ERROR)
    engine.apply(strict=False)
print(json.dumps({
    "hook_active": hook_active,
    "activation_error": engine.activation_error(),
    "import_errors": errors,
    "patches": [s.as_dict() for s in engine.status()],
    "shadowed": shadowed,
}))
"""

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
    parser.add_argument("--no-verify", action="store_true", help="skip the fresh-subprocess check")
    parser.add_argument(
        "--env",
        action="store_true",
        help="print the block to paste into a bug report (versions, accelerator, hook, patches, changed "
        "settings; no model runs); with --json, the same keys as one object. `attn-overlay env` is the same",
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
    return args, rest


def interpreter_flags() -> list[str]:
    """The flags this interpreter was started with (-S, -I, -E, -X ...), for a child that must
    see what the caller's processes see."""
    try:
        return list(subprocess._args_from_interpreter_flags())  # what multiprocessing uses
    except Exception:  # a private helper; without it, rebuild the common flags
        flags = sys.flags
        out = ["-S"] * bool(flags.no_site)  # -I does not imply -S: site-packages .pth files still run
        if flags.isolated:
            out.append("-I")
        else:
            out += ["-E"] * bool(flags.ignore_environment) + ["-s"] * bool(flags.no_user_site)
            out += ["-P"] * bool(getattr(flags, "safe_path", False))
        return out


def _package_root() -> str:
    """The folder holding this overlay package (site-packages, or a source tree's root)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _verify_in_subprocess(timeout: float = 300.0) -> dict:
    code = f"PACKAGE_ROOT = {_package_root()!r}\n" + _VERIFY_CODE
    command = [sys.executable, *interpreter_flags(), "-c", code]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"the verification subprocess did not finish in {timeout:.0f} s"}
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        return {"error": "the verification subprocess failed: " + " | ".join(tail)}
    try:
        result = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"unexpected output from the verification subprocess: {done.stdout[-300:]!r}"}
    if not result.get("shadowed"):
        said = [line for line in done.stderr.splitlines() if line.startswith(environment.SHADOW_PREFIX)]
        result["shadowed"] = said[-1] if said else None
    return result


def build_report(verify: bool = True) -> dict:
    """The ``--json`` document (see the module docstring)."""
    version = engine.installed_transformers_version()
    report: dict = {
        "schema": SCHEMA,
        "overlay_version": __version__,
        "python": sys.version.split()[0],
        "transformers_version": version,
        "hook": {"active": None, "verified": False, "reason": None},
        "patches": [],
        "import_errors": {},
        "settings": {value.setting.name: value.as_dict() for value in environment.settings_in_force()},
        "ok": True,
    }
    if not verify or version is None:
        report["patches"] = [dict(s.as_dict(), would_be=None) for s in engine.status()]
        if version is None:
            report["hook"]["reason"] = "transformers is not installed: nothing to patch"
        return _finish(report)
    verified = _verify_in_subprocess()
    if "error" in verified:
        report["hook"] = {"active": False, "verified": False, "reason": verified["error"]}
        report["patches"] = [dict(s.as_dict(), would_be=None) for s in engine.status()]
        return _finish(report)
    active = bool(verified["hook_active"])
    reason = None
    if not active:
        shadowed = verified.get("shadowed")
        reason = environment.shadow_reason(shadowed) if shadowed else verified.get("activation_error")
        reason = reason or why_the_hook_is_inactive()
    report["hook"] = {"active": active, "verified": True, "reason": reason}
    report["import_errors"] = verified.get("import_errors", {})
    for row in verified["patches"]:
        if active:
            row["would_be"] = None
        else:  # no process gets these patches: never say "applied"
            row["would_be"], row["state"] = row["state"], engine.INACTIVE
        report["patches"].append(row)
    return _finish(report)


def setting_problems(report: dict) -> list[str]:
    """The report's bad settings: values outside the table (``--strict`` exits 1 on any)."""
    return [entry["problem"] for entry in report["settings"].values() if entry["problem"]]


def _settings_table(settings: dict) -> str:
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


def _finish(report: dict) -> dict:
    states = {row["would_be"] or row["state"] for row in report["patches"]}
    report["ok"] = not (states & engine.BAD_STATES)
    report["summary"] = _older_than_every_patch(report["transformers_version"], states)
    return report


def _older_than_every_patch(version: str | None, states: set) -> str | None:
    """One line for a release older than the lowest release any patch was written for."""
    if version is None or states != {engine.OUT_OF_RANGE}:
        return None
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    from .patch import lowest_release

    lowest = [low for p in engine.known_patches() if (low := lowest_release(SpecifierSet(p.affected))) is not None]
    try:
        older = bool(lowest) and Version(version) < min(lowest)
    except InvalidVersion:
        return None
    if not older:
        return None
    return (
        f"transformers {version} is older than {min(lowest)}, the oldest release any patch was written for: "
        "nothing is patched or checked here (the accelerator stacks' pins start at 4.55)"
    )


def _table(rows: list[dict]) -> str:
    headers = ("patch", "status", "why")
    body = [
        (r["id"], r["state"] if not r.get("would_be") else f"{r['state']} (would be: {r['would_be']})", r["reason"])
        for r in rows
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(headers[:2])]
    lines = [f"{headers[0]:<{widths[0]}}  {headers[1]:<{widths[1]}}  {headers[2]}"]
    lines.append(f"{'-' * widths[0]}  {'-' * widths[1]}  {'-' * 3}")
    for pid, state, why in body:
        lines.append(f"{pid:<{widths[0]}}  {state:<{widths[1]}}  {why}")
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
    _hand_down_to_children(strict=engine.settings().strict)
    if args.module:
        cannot = _cannot_run_module(args.module)
        if cannot is not None:  # what `python -m MODULE` prints, and its exit status
            print(f"{sys.executable}: {cannot}", file=sys.stderr)
            return 1
        sys.argv = [args.module, *rest]
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        return 0
    program, *program_args = rest
    cannot = _cannot_run_path(program)
    if cannot is not None:  # what `python PROGRAM` prints, and its exit status
        message, status = cannot
        print(f"{sys.executable}: {message}", file=sys.stderr)
        return status
    sys.argv = [program, *program_args]
    if not os.path.isdir(program):  # run_path puts a folder (or zip) itself first on sys.path
        sys.path.insert(0, os.path.dirname(os.path.abspath(program)))
    runpy.run_path(program, run_name="__main__")
    return 0


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
