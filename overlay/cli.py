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
``ok``                what the exit status says: no patch failed or met unrecognised code (and, in
                      strict mode, the hook is active)
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
from typing import Sequence

from . import config, engine
from ._version import __version__

SCHEMA = 1

USAGE = """\
python -m overlay.apply [--json] [--strict] [--no-verify]
python -m overlay.apply [--strict] PROGRAM.py [ARGS...]
python -m overlay.apply [--strict] -m MODULE [ARGS...]"""

DESCRIPTION = """\
Without a program: show every patch with its status for the installed transformers, and verify
in a fresh subprocess (same interpreter, same flags) that the startup hook really activates the
overlay there. With a program or -m MODULE: run it with the patches applied (for environments
where startup hooks are not processed, e.g. `python -S`, embedded interpreters, or ATTN_OVERLAY=0)."""

# Imports the patch target modules the way a user program would, then reports what happened.
# It never calls overlay.apply() before reading hook_active: whatever is active there was
# activated by the startup hook.
_VERIFY_CODE = """
import importlib, json, logging
import overlay.engine as engine
modules = sorted({p.module for p in engine.known_patches()})
errors = {}
for name in modules:
    try:
        importlib.import_module(name)
    except Exception as exc:
        errors[name] = f"{type(exc).__name__}: {exc}"
hook_active = engine.is_active()
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
}))
"""


def _parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m overlay.apply", usage=USAGE, description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"attn-overlay {__version__}")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (schema: see overlay/cli.py)")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="exit non-zero (report) or raise (program) when a patch meets unrecognised code, "
        "fails, or the hook is inactive; same as ATTN_OVERLAY_STRICT=1",
    )
    parser.add_argument("--no-verify", action="store_true", help="skip the fresh-subprocess check")
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
    return parser.parse_args(options), rest


def interpreter_flags() -> list[str]:
    """The flags this interpreter was started with (-S, -I, -E, -X ...), for a child that must
    see what the caller's processes see."""
    try:
        return list(subprocess._args_from_interpreter_flags())  # what multiprocessing uses
    except Exception:  # noqa: BLE001 -- a private helper; without it, rebuild the common flags
        flags = sys.flags
        out = []
        if flags.isolated:
            out.append("-I")
        else:
            out += ["-S"] * bool(flags.no_site) + ["-E"] * bool(flags.ignore_environment)
            out += ["-s"] * bool(flags.no_user_site)
        return out


def _verify_in_subprocess(timeout: float = 300.0) -> dict:
    command = [sys.executable, *interpreter_flags(), "-c", _VERIFY_CODE]
    if sys.flags.isolated or sys.flags.safe_path:
        # -I / -P leave the working directory off sys.path: the child must find this overlay
        # package by its path, as the caller did.
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        command[-1] = f"import sys; sys.path.append({package_root!r})\n" + _VERIFY_CODE
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
    shadow = [line for line in done.stderr.splitlines() if line.startswith("attn-overlay: NOT active")]
    if shadow:
        result["shadowed"] = shadow[-1]
    return result


def why_the_hook_is_inactive() -> str:
    """The likeliest real cause, checked in this order; the first that holds is the answer."""
    if not config.auto_enabled():
        return f"{config.ENABLE_VAR}={os.environ.get(config.ENABLE_VAR)} is set: the startup hook is turned off"
    if sys.flags.no_site:
        return "python was started with -S (or -I): site-packages .pth files, the startup hook among them, are not read"
    try:
        import _attn_overlay_startup as startup

        shadow = startup.shadowing_module()
        if shadow:
            return shadow.removeprefix("attn-overlay: ")
    except ImportError:
        pass
    pth = _installed_pth()
    if pth is None:
        on_path = [p for p in sys.path if p and os.path.isfile(os.path.join(p, "attn_overlay.pth"))]
        if on_path:
            return (
                f"attn_overlay.pth is in {on_path[0]}, which is on sys.path but not a site directory "
                "(`pip install --target` + PYTHONPATH?): Python reads .pth files only in site directories. "
                "Install attn-overlay into the environment itself, or run programs with `python -m overlay.apply PROGRAM.py`"
            )
        if _editable_install():
            return (
                "attn-overlay is installed in editable mode (`pip install -e`), which does not ship the "
                "startup file attn_overlay.pth; install it as a regular package (`pip install .`)"
            )
        return (
            "attn-overlay is not installed in this environment (no attn_overlay.pth in its site-packages); "
            "`pip install attn-overlay` (or `pip install .` in a clone)"
        )
    return f"the startup hook ({pth}) did not activate; see the activation error above, if any"


def _installed_pth() -> str | None:
    import site

    folders = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE:
        folders.append(site.getusersitepackages())
    for folder in folders:
        candidate = os.path.join(folder, "attn_overlay.pth")
        if os.path.isfile(candidate):
            return candidate
    return None


def _editable_install() -> bool:
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        direct_url = distribution("attn-overlay").read_text("direct_url.json") or ""
    except PackageNotFoundError:
        return False
    try:
        return bool(json.loads(direct_url).get("dir_info", {}).get("editable"))
    except ValueError:
        return False


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
        reason = verified.get("shadowed", "").removeprefix("attn-overlay: ") or verified.get("activation_error")
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


def _finish(report: dict) -> dict:
    states = {row["would_be"] or row["state"] for row in report["patches"]}
    report["ok"] = not (states & engine.BAD_STATES)
    return report


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
    if strict and hook["active"] is False:
        result["ok"] = False
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        version = result["transformers_version"]
        print(f"attn-overlay {__version__} | transformers {version or 'not installed'} | python {result['python']}")
        print(_table(result["patches"]))
        if hook["active"] is True:
            print("\nstartup hook: active (verified in a fresh subprocess with this interpreter's flags)")
        elif hook["active"] is False:
            print(
                f"\nstartup hook: NOT active: {hook['reason']}"
                "\n  No program gets these patches until then, except through `python -m overlay.apply PROGRAM.py`"
                " or `overlay.apply()`; the status column says what they would reach."
            )
        elif hook["reason"]:
            print(f"\n{hook['reason']}")
    return 0 if result["ok"] else 1


def run_program(args: argparse.Namespace, rest: list[str]) -> int:
    engine.apply(strict=True if args.strict else None)
    if args.module:
        sys.argv = [args.module, *rest]
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
    else:
        program, *program_args = rest
        if not os.path.exists(program):
            print(f"python -m overlay.apply: can't open file {program!r}: no such file", file=sys.stderr)
            return 2
        sys.argv = [program, *program_args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(program)))
        runpy.run_path(program, run_name="__main__")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args, rest = _parse(sys.argv[1:] if argv is None else argv)
    if args.module or rest:
        return run_program(args, rest)
    try:
        return report(args)
    except BrokenPipeError:
        # Piped into `head`: the reader left. Point stdout at devnull so the interpreter's own
        # flush at exit does not raise again (the pattern the Python docs give for SIGPIPE).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
