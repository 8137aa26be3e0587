"""The generated tables, README.md's fixes, docs/errors.md's error texts and docs/releases.md's
release matrix, come from the patch files (scripts/readme_table.py), and `--check` fails when any is
stale; README stays short as patches are added (rows of at most 240 characters, at most 130 lines of
prose: the lines outside the generated blocks, markers included in the blocks); one more patch (a 29th, when
28 are shipped) changes README only through the generator; docs/benchmarks.md is generated from its data."""

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


def test_fixes_table_has_a_short_row_per_listed_patch_from_its_own_fields():
    from overlay import patches as package

    rows = _fixes_rows(readme_table.README.read_text(encoding="utf-8"))
    # Every patch patches/__init__.py lists, in its order: a new patch file gets its row.
    assert len(rows) == len(PATCHES) == len(package.PATCH_MODULES)
    for patch, name, row in zip(PATCHES, package.PATCH_MODULES, rows):
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert cells[0] == f"[`{patch.id}`](patches/{name}.py)"
        assert (REPO / "patches" / f"{name}.py").is_file()
        title = readme_table.cell(patch.title)
        # The title, whole or cut at a word with an ellipsis.
        assert cells[1] == title or (cells[1].endswith("…") and title.startswith(cells[1][:-1])), cells[1]
        assert cells[3] == (patch.fixed_in and readme_table.short_upstream(patch) or "not yet")
        assert cells[4] == (getattr(patch, "changes", None) or readme_table.NO_CHANGES_FIELD)
        assert len(row) <= readme_table.MAX_ROW, (len(row), row)


def test_the_errors_page_has_a_section_per_patch_with_every_error_text_verbatim():
    text = readme_table.ERRORS_DOC.read_text(encoding="utf-8")
    sections = text.split("\n## ")[1:]
    # The heading is the id alone: GitHub's anchor for it is docs/errors.md#<id>.
    assert [section.splitlines()[0] for section in sections] == [p.id for p in PATCHES]
    for patch, section in zip(PATCHES, sections):
        assert f"**{patch.title}**" in section
        assert f"- upstream: {patch.upstream}" in section
        for error in patch.errors:
            assert f"```text\n{error}\n```" in section


def test_short_upstream_names_the_fix_release_and_its_own_pull_request_only():
    patch = PATCHES[0]
    own = dataclasses.replace(patch, upstream="huggingface/transformers#123 (x), in 5.20.0", fixed_in="5.20.0")
    earlier = dataclasses.replace(patch, upstream="fixed in 5.20.0; part since 5.0.0 (huggingface/transformers#9)",
                                  fixed_in="5.20.0")
    assert readme_table.short_upstream(own) == "5.20.0 (#123)"
    assert readme_table.short_upstream(earlier) == "5.20.0"  # #9 fixed another part, earlier
    assert readme_table.short_upstream(dataclasses.replace(patch, fixed_in=None)) == "not yet"


def test_check_fails_on_a_stale_table_and_the_script_repairs_it(tmp_path, capsys):
    title = readme_table.cell(PATCHES[0].title)
    for document, old, new in (
        (readme_table.README, f"| {title} |", "| an old title |"),  # the fixes table
        (readme_table.ERRORS_DOC, f"**{PATCHES[0].title}**", "**an old title**"),  # the errors page
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
    errors = readme_table.ERRORS_DOC.read_text(encoding="utf-8")
    assert readme_table.FIXES_START in readme and readme_table.SETTINGS_START in readme
    assert readme_table.ERRORS_START in errors and readme_table.ERRORS_START not in readme
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
    assert "a \\| b" in row


def test_the_readmes_pinned_stack_example_points_at_a_row_of_the_release_table():
    # The example names no patch and no count (a new patch would make those stale): it points at
    # the generated row of its release, which must then exist.
    import re

    text = readme_table.README.read_text(encoding="utf-8")
    section = text.split("## Install it on a pinned stack", 1)[1].split("\n## ", 1)[0]
    release = re.search(r"^transformers==(\S+)$", section, re.M).group(1)
    assert "docs/releases.md" in section
    assert f"\n| {release} | " in readme_table.RELEASES_DOC.read_text(encoding="utf-8")


def test_the_benchmarks_page_is_generated_from_its_data(capsys):
    import benchmarks_doc

    assert benchmarks_doc.main(["--check"]) == 0, capsys.readouterr().err


#: README's prose (the lines outside its generated blocks) stays a page a user reads.
MAX_PROSE_LINES = 130


def _readme_problems(readme: str, patches) -> list[str]:
    """What breaks README's promises for ``patches``: a row per patch, short rows, short prose."""
    problems = []
    rows = _fixes_rows(readme)
    if [row.split("`", 2)[1] for row in rows] != [p.id for p in patches]:
        problems.append(f"rows {len(rows)} for {len(patches)} patches")
    problems += [f"row of {len(row)} characters: {row}" for row in rows if len(row) > readme_table.MAX_ROW]
    prose = readme_table.prose_lines(readme)
    if len(prose) > MAX_PROSE_LINES:
        problems.append(f"{len(prose)} lines of prose")
    return problems


def test_the_readme_stays_a_page_for_users():
    # The accounts live in docs/ and CONTRIBUTING; the README says what it fixes and how to use it.
    assert _readme_problems(readme_table.README.read_text(encoding="utf-8"), PATCHES) == []


def test_prose_is_every_line_outside_the_generated_blocks():
    text = "\n".join(["# t", "a", readme_table.FIXES_START, "| x |", "| y |", readme_table.FIXES_END,
                      "b", readme_table.SETTINGS_START, "| z |", readme_table.SETTINGS_END, ""])
    assert readme_table.prose_lines(text) == ["# t", "a", "b"]


def test_one_more_patch_changes_the_readme_only_through_the_generator():
    # A patch as long-winded as any: the longest id, title and error texts of the shipped ones and
    # more. The README, regenerated, keeps every promise with no hand edit of its prose.
    longest_id = max((p.id for p in PATCHES), key=len)
    extra = dataclasses.replace(
        PATCHES[-1],
        id=f"{longest_id}-and-one-more",
        title=" ".join(p.title for p in PATCHES[:3]),
        errors=tuple(e for p in PATCHES[:4] for e in p.errors),
        upstream=max((p.upstream for p in PATCHES), key=len),
    )
    patches = [*PATCHES, extra]
    files = {extra.id: "patches/one_more.py"}
    readme = readme_table.render_readme(readme_table.README.read_text(encoding="utf-8"), patches, files)
    assert len(_fixes_rows(readme)) == len(PATCHES) + 1  # the 29th when 28 are shipped
    assert _readme_problems(readme, patches) == []
    errors = readme_table.render_readme(readme_table.ERRORS_DOC.read_text(encoding="utf-8"), patches, files)
    assert f"\n## {extra.id}\n" in errors and all(e in errors for e in extra.errors)
