"""The generated tables, README.md's fixes and docs/releases.md's release matrix, come from the patch
files (scripts/readme_table.py), and `--check` fails when either is stale; README.md's claims about
a pinned stack's release match the matrix; docs/benchmarks.md is generated from its data."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
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
    title = readme_table.cell(PATCHES[0].title)
    for document, old, new in (
        (readme_table.README, f"| {title} |", "| an old title |"),  # the fixes table
        (readme_table.RELEASES_DOC, "| 5.13.0 | applied |", "| 5.13.0 | out of range |"),  # the release table
    ):
        current = readme_table.render_readme(document.read_text(encoding="utf-8"))
        stale = current.replace(old, new, 1)
        assert stale != current
        readme = tmp_path / document.name
        readme.write_text(stale, encoding="utf-8")
        assert readme_table.main(["--check", "--readme", str(readme)]) == 1
        assert "stale" in capsys.readouterr().err
        assert readme.read_text(encoding="utf-8") == stale  # --check never writes
        assert readme_table.main(["--readme", str(readme)]) == 0
        assert readme.read_text(encoding="utf-8") == current
        assert readme_table.main(["--check", "--readme", str(readme)]) == 0


def test_each_document_holds_its_tables():
    readme = readme_table.README.read_text(encoding="utf-8")
    releases = readme_table.RELEASES_DOC.read_text(encoding="utf-8")
    assert readme_table.FIXES_START in readme and readme_table.SETTINGS_START in readme
    assert readme_table.START in releases and readme_table.START not in readme


def test_a_document_without_any_table_is_an_error(tmp_path, capsys):
    empty = tmp_path / "notes.md"
    empty.write_text("# no tables here\n", encoding="utf-8")
    assert readme_table.main(["--check", "--readme", str(empty)]) == 2
    assert "holds no generated table" in capsys.readouterr().err


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


def test_the_readmes_pinned_stack_example_says_what_the_matrix_says():
    # "Then `python -m overlay.apply` says, for that release: N patches applied; `c` and `d` out
    # of range": the example's release is the one its requirements pin.
    import re

    text = readme_table.README.read_text(encoding="utf-8")
    section = text.split("## Install it on a pinned stack", 1)[1].split("\n## ", 1)[0]
    release = re.search(r"^transformers==(\S+)$", section, re.M).group(1)
    said = re.search(r"says, for that release: (\d+) patches applied;(.*?) out of range", section, re.S)
    table = matrix_data.matrix([release], PATCHES)[release]
    assert int(said.group(1)) == sum(s == matrix_data.APPLIED for s in table.values())
    assert set(re.findall(r"`([\w-]+)`", said.group(2))) == {p for p, s in table.items() if s == matrix_data.OUT_OF_RANGE}


def test_the_benchmarks_page_is_generated_from_its_data(capsys):
    import benchmarks_doc

    assert benchmarks_doc.main(["--check"]) == 0, capsys.readouterr().err


def test_the_readme_stays_a_page_for_users():
    # The accounts live in docs/ and CONTRIBUTING; the README says what it fixes and how to use it.
    assert len(readme_table.README.read_text(encoding="utf-8").splitlines()) <= 170
