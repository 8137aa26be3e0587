"""README.md's two tables, the fixes and the release matrix, are generated from the patch files
(scripts/readme_table.py), and `--check` fails when either is stale."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import matrix_data  # noqa: E402
import readme_table  # noqa: E402

PATCHES = matrix_data.load_patches()


def _fixes_rows(text: str) -> list[str]:
    block = text[text.index(readme_table.FIXES_START) : text.index(readme_table.FIXES_END)]
    return [line for line in block.splitlines() if line.startswith("| [`")]


def test_readme_tables_are_current(capsys):
    # In this process: the overlay and patches under test, whatever else is installed.
    assert readme_table.main(["--check"]) == 0, capsys.readouterr().err


def test_fixes_table_has_a_row_per_listed_patch_from_its_own_fields():
    from overlay import patches as package

    rows = _fixes_rows(readme_table.README.read_text(encoding="utf-8"))
    # Every patch patches/__init__.py lists, in its order: a new patch file gets its row.
    assert len(rows) == len(PATCHES) == len(package.PATCH_MODULES)
    for patch, name, row in zip(PATCHES, package.PATCH_MODULES, rows):
        assert row.startswith(f"| [`{patch.id}`](patches/{name}.py) | {readme_table.cell(patch.title)} | ")
        assert (REPO / "patches" / f"{name}.py").is_file()
        for error in patch.errors:
            assert f"`{readme_table.cell(error)}`" in row
        assert readme_table.cell(patch.upstream) in row
        if patch.fixed_in is not None:
            assert patch.fixed_in in row


def test_check_fails_on_a_stale_table_and_the_script_repairs_it(tmp_path, capsys):
    current = readme_table.render_readme(readme_table.README.read_text(encoding="utf-8"))
    title = readme_table.cell(PATCHES[0].title)
    for stale in (
        current.replace(f"| {title} |", "| an old title |", 1),  # the fixes table
        current.replace("| 5.13.0 | applied |", "| 5.13.0 | out of range |", 1),  # the release table
    ):
        assert stale != current
        readme = tmp_path / "README.md"
        readme.write_text(stale, encoding="utf-8")
        assert readme_table.main(["--check", "--readme", str(readme)]) == 1
        assert "stale" in capsys.readouterr().err
        assert readme.read_text(encoding="utf-8") == stale  # --check never writes
        assert readme_table.main(["--readme", str(readme)]) == 0
        assert readme.read_text(encoding="utf-8") == current
        assert readme_table.main(["--check", "--readme", str(readme)]) == 0


def test_a_readme_without_the_markers_is_an_error(tmp_path):
    readme = tmp_path / "README.md"
    current = readme_table.README.read_text(encoding="utf-8")
    readme.write_text(current.replace(readme_table.FIXES_END, ""), encoding="utf-8")
    assert readme_table.main(["--check", "--readme", str(readme)]) == 2


def test_affected_releases_are_written_as_ranges_of_the_matrix():
    releases = matrix_data.RELEASES

    def affected(affected, fixed_in):
        patch = dataclasses.replace(PATCHES[0], affected=affected, fixed_in=fixed_in)
        return readme_table.affected_releases(patch, releases, matrix_data.matrix(releases, [patch]))

    assert affected(">=5.13.0,<5.15.0", "5.15.0") == "5.13.0 – 5.14.1"
    assert affected(">=5.13.0", None) == "5.13.0 and later"
    assert affected(">=5.13.0,!=5.16.*,<5.20.0", "5.20.0") == "5.13.0 – 5.15.1, 5.17.0 – 5.19.0"
    assert affected("==5.17.0", None) == "5.17.0"
    assert affected("<4.0", None) == f"none of {releases[0]} – {releases[-1]} (`<4.0`)"  # before every lane


def test_a_pipe_in_a_field_does_not_split_the_row():
    patch = dataclasses.replace(PATCHES[0], title="a | b", errors=("x | y",))
    row = readme_table.render_fixes(patches=[patch]).splitlines()[-1]
    assert row.replace("\\|", "").count("|") == 6  # five cells
