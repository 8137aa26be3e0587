"""The doctor's report as text."""

from __future__ import annotations

import textwrap
from typing import Any

from overlay.report import describe_actions

WIDTH = 100


def render(report: dict[str, Any]) -> str:
    env = report["environment"]
    out: list[str] = [f"attn-overlay doctor (attn-overlay {env['overlay_version']})", ""]

    out.append("environment")
    rows = [("python", env["python"]), ("platform", env["platform"])]
    for name, version in env["packages"].items():
        rows.append((name, version or "not installed"))
    accelerators = env["accelerators"]
    rows.append(("accelerators", ", ".join(f"{a['device']} {a['name']}" for a in accelerators) or "none found"))
    device = env["device"]
    rows.append(("device", f"{device['device']} ({device['description']})"))
    if env.get("world_size", 1) > 1:
        rows.append(("torchrun", f"world size {env['world_size']}"))
    fake = device.get("fake_device") or {}
    wrapped = []  # rows whose text can be long: wrapped under their value column
    if fake.get("backend_text"):
        # Which implementation ran, and why the pure-Python one (a reason the reader can act on).
        wrapped.append(("fake backend", fake["backend_text"]))
    if fake.get("cache_dir"):
        held = fake.get("cache_bytes")
        wrapped.append((
            "cache folder",
            f"{fake['cache_dir']} (not created)" if held is None else
            f"{fake['cache_dir']} ({_size(held)}; pip uninstall leaves it: rm -rf {fake['cache_dir']} removes it)",
        ))
    width = max(len(k) for k, _ in rows + wrapped)
    out += _pairs(rows, width)
    for key, value in wrapped:
        out += _wrap(f"{key:<{width}}  {value}", "  ", hang=width + 2)
    for problem in env.get("detection_problems", ()):
        out.append(f"  ! {problem}")
    out.append("")

    for note in device.get("notes", ()):
        out += _wrap(note, "")
        out.append("")

    status = report.get("overlay_status")
    if status:
        out.append("overlay patches (as the with-overlay runs saw them)")
        width = max(len(s["id"]) for s in status)
        state_width = max(len(s["state"]) for s in status)
        for s in status:
            if s["state"] in ("applied", "fixed upstream") and s.get("variants"):
                # Which known code the fingerprints recognised, e.g. "code of 5.18.0-5.19.0".
                detail = "code of " + ", ".join(dict.fromkeys(s["variants"]))
            else:
                detail = s["reason"]
            out += _wrap(f"{s['id']:<{width}}  {s['state']:<{state_width}}  {detail}", "  ", hang=width + state_width + 4)
        out.append("")

    out.append("verdict")
    scenarios = report["scenarios"]
    id_width = max([len("scenario")] + [len(s["id"]) for s in scenarios])
    out.append(f"  {'scenario':<{id_width}}  {'without overlay':<22}  with overlay")
    out.append(f"  {'-' * id_width}  {'-' * 22}  {'-' * 22}")
    for s in scenarios:
        if s["status"] == "skipped":
            out.append(f"  {s['id']:<{id_width}}  {'skipped: ' + s['why']}")
            continue
        out.append(f"  {s['id']:<{id_width}}  {_cell(s['without']):<22}  {_cell(s['with'], with_overlay=True)}")
    out.append("")

    details = [s for s in scenarios if s["status"] != "skipped"]
    if details:
        out.append("what ran")
        for s in details:
            out.append(f"  {s['id']}: {s['title']}")
            states = s["with"].get("patches", {})
            patches = ", ".join(f"{p} {states.get(p, 'not in this overlay')}" for p in s["patches"])
            out.append(f"    overlay: {patches}")
            fired = s["with"].get("fired") or {}
            for patch_id, actions in sorted(fired.items()):
                out.append(f"    fired with overlay: {patch_id}: {describe_actions(actions)}")
            if not fired and s["with"].get("fired") is not None:
                out.append("    fired with overlay: nothing (no call needed a fix)")
            for mode in ("without", "with"):
                result = s[mode]
                if result.get("error") and not result.get("cases"):
                    out += _wrap(f"{mode} overlay: {result['error']}", "    ")
                # Cases failing the same way are listed together.
                failures: dict[str, list[str]] = {}
                for case in result.get("cases", ()):
                    if not case["ok"]:
                        failures.setdefault(case["error"], []).append(case["name"])
                for error, names in failures.items():
                    out += _wrap(f"{mode} overlay, {'; '.join(names)}: {error}", "    ")
            if s["with"]["ok"]:
                same = _same_tokens(s)
                out.append(f"    with overlay: every case generated the same tokens as its reference run{same}")
        out.append("")

    for note in report.get("notes", ()):
        out += _wrap(note, "")
    ran = [s for s in scenarios if s["status"] != "skipped"]
    fixed = [s["id"] for s in ran if s.get("fixed_by_overlay")]
    failing = [s["id"] for s in ran if s["status"] != "pass"]
    if report["ok"]:
        summary = f"result: every scenario passes with the overlay ({len(ran)} of {len(ran)})"
        if fixed:
            summary += f"; {len(fixed)} fail without it ({', '.join(fixed)})"
    elif ran:
        summary = f"result: {len(failing)} of {len(ran)} scenarios fail with the overlay ({', '.join(failing)})"
    else:
        summary = "result: no scenario ran"
    out.append(summary + f"  [{report.get('seconds', 0):.0f} s]")
    return "\n".join(out)


def _cell(result: dict, with_overlay: bool = False) -> str:
    cases = result.get("cases", ())
    if result["ok"]:
        return f"pass ({len(cases)}/{len(cases)} cases)"
    if not cases:
        return "FAIL (did not run)"
    passed = sum(1 for c in cases if c["ok"])
    return f"FAIL ({passed}/{len(cases)} cases)"


def _same_tokens(scenario: dict) -> str:
    checks = [c.get("identical_to_stock_reference") for c in scenario["with"].get("cases", ())]
    checks = [c for c in checks if c is not None]
    if checks and all(checks):
        return ",\n      and as the stock (without-overlay) reference runs"
    if checks:
        return ",\n      but NOT always as the stock reference runs"
    return ""


def _pairs(rows: list[tuple[str, str]], width: int | None = None) -> list[str]:
    width = width or max(len(k) for k, _ in rows)
    return [f"  {k:<{width}}  {v}" for k, v in rows]


def _size(count: int) -> str:
    if count < 1024:
        return "empty" if count == 0 else f"{count} bytes"
    scaled = float(count)
    for unit in ("KiB", "MiB", "GiB"):
        scaled /= 1024
        if scaled < 1024 or unit == "GiB":
            return f"{scaled:.0f} {unit}"
    return f"{scaled:.0f} GiB"


def _wrap(text: str, indent: str, hang: int = 2) -> list[str]:
    lines = textwrap.wrap(
        text, WIDTH, initial_indent=indent, subsequent_indent=indent + " " * hang, break_on_hyphens=False
    )
    return lines or [indent]
