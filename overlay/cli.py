"""The command line of ``python -m overlay.apply``."""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
from typing import Sequence

from . import config, engine

USAGE = """\
python -m overlay.apply [--json] [--strict] [--no-verify]
python -m overlay.apply [--strict] PROGRAM.py [ARGS...]
python -m overlay.apply [--strict] -m MODULE [ARGS...]"""

DESCRIPTION = """\
Without a program: show every patch with its status for the installed transformers, and verify
in a fresh subprocess that the startup hook really activates the overlay there.
With a program or -m MODULE: run it with the patches applied (for environments where startup
hooks are not processed, e.g. `python -S`, embedded interpreters, or ATTN_OVERLAY=0)."""

# Imports the patch target modules the way a user program would, then reports what happened.
# It never calls overlay.apply(): whatever is active there was activated by the startup hook.
_VERIFY_CODE = """
import importlib, json, sys
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
    # Still show what the patches would do here: the same gate, on the same code, applied
    # explicitly (the modules are imported already, so the late-import warning is expected).
    import logging
    logging.getLogger("overlay").setLevel(logging.ERROR)
    engine.apply(strict=False)
print(json.dumps({
    "hook_active": hook_active,
    "startup_error": engine.activation_error(),
    "import_errors": errors,
    "status": [s.as_dict() for s in engine.status()],
}))
"""


def _parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m overlay.apply", usage=USAGE, description=DESCRIPTION)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
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
        args = parser.parse_args(options)
        return args, rest
    args = parser.parse_args(options)
    return args, rest


def _verify_in_subprocess(timeout: float = 300.0) -> dict:
    env = dict(os.environ)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _VERIFY_CODE],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"the verification subprocess did not finish in {timeout:.0f} s"}
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        return {"error": "the verification subprocess failed: " + " | ".join(tail)}
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"unexpected output from the verification subprocess: {done.stdout[-300:]!r}"}


def _table(rows: list[dict]) -> str:
    headers = ("patch", "status", "why")
    body = [(r["id"], r["state"], r["reason"]) for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(headers[:2])]
    lines = [f"{headers[0]:<{widths[0]}}  {headers[1]:<{widths[1]}}  {headers[2]}"]
    lines.append(f"{'-' * widths[0]}  {'-' * widths[1]}  {'-' * 3}")
    for pid, state, why in body:
        lines.append(f"{pid:<{widths[0]}}  {state:<{widths[1]}}  {why}")
    return "\n".join(lines)


def report(args: argparse.Namespace) -> int:
    version = engine.installed_transformers_version()
    result: dict = {"transformers": version, "python": sys.version.split()[0], "auto_enabled": config.auto_enabled()}
    if args.no_verify or version is None:
        result["hook_active"] = None
        result["status"] = [s.as_dict() for s in engine.status()]
        if version is None:
            result["note"] = "transformers is not installed: nothing to patch"
    else:
        verified = _verify_in_subprocess()
        if "error" in verified:
            result["hook_active"] = False
            result["verify_error"] = verified["error"]
            result["status"] = [s.as_dict() for s in engine.status()]
        else:
            result.update(verified)
    bad = [r for r in result["status"] if r["state"] in engine.BAD_STATES]
    inactive = version is not None and result.get("hook_active") is False
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"attn-overlay {__import__('overlay').__version__} | transformers {version or 'not installed'} | python {result['python']}")
        print(_table(result["status"]))
        if result.get("hook_active") is True:
            print("\nstartup hook: active (verified in a fresh subprocess)")
        elif result.get("hook_active") is False:
            why = result.get("verify_error") or result.get("startup_error")
            if not config.auto_enabled():
                why = f"{config.ENABLE_VAR}=0 is set"
            print(
                "\nstartup hook: NOT active" + (f" ({why})" if why else "")
                + "\n  the table shows what `overlay.apply()` does in this environment; the fixes reach a "
                "program only through `python -m overlay.apply PROGRAM.py` or `overlay.apply()`."
                "\n  To get the hook: install attn-overlay with pip as a regular package (an editable "
                "`pip install -e` install does not ship the .pth file), and unset ATTN_OVERLAY=0"
            )
    strict = args.strict or config.strict_from_env()
    return 1 if strict and (bad or inactive) else 0


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
    return report(args)
