"""The patch format's own rules (``overlay.patch``), independent of any release."""

from __future__ import annotations

import pytest

from overlay.patch import Target, Variant


def _target(originals, **defaults):
    return Target(module="m", qualname="f", originals=originals, replace=lambda original, variant: original, defaults=defaults)


def test_a_variant_reads_the_targets_defaults_where_it_states_nothing():
    target = _target({"a" * 64: Variant("1.0.0"), "b" * 64: Variant("2.0.0", {"late": True})}, late=False, width=8)
    old, new = target.originals["a" * 64], target.originals["b" * 64]
    assert (old["late"], old["width"]) == (False, 8)
    assert (new["late"], new["width"]) == (True, 8)
    assert target.originals["a" * 64].label == "1.0.0"


def test_a_label_string_is_a_variant_with_the_defaults():
    assert _target({"a" * 64: "1.0.0"}, late=False).originals["a" * 64]["late"] is False


def test_a_parameter_the_defaults_do_not_declare_is_refused():
    with pytest.raises(ValueError, match=r"variant '2.0.0' sets 'lat', which the target's defaults do not declare \('late'\)"):
        _target({"b" * 64: Variant("2.0.0", {"lat": True})}, late=False)


def test_without_defaults_a_missing_parameter_is_named():
    variant = _target({"a" * 64: Variant("1.0.0", {"late": True})}).originals["a" * 64]
    with pytest.raises(KeyError, match="variant '1.0.0' declares no parameter 'width'"):
        variant["width"]


def test_every_patch_files_docstring_is_a_summary_the_history_lives_in_docs():
    # CONTRIBUTING: what breaks, the error, what the replacement does, its limits, about 40 lines;
    # the per-release account goes to docs/patches/<patch-id>.md.
    import ast
    from pathlib import Path

    from overlay import _patch_files

    too_long = {}
    for path in sorted(Path(_patch_files.package().__file__).parent.glob("*.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False) or ""
        if len(docstring.splitlines()) > 60:
            too_long[path.name] = len(docstring.splitlines())
    assert too_long == {}


def test_the_argument_reader_finds_an_argument_by_keyword_or_by_position():
    from overlay.patch import argument_reader, wraps

    class Mixin:
        def build(self, config, model_kwargs=None, *extra, logits_processor=None, **rest):
            return config

    @wraps(Mixin.build)
    def layered(self, *args, **kwargs):  # another patch's wrapper: the reader sees through it
        return Mixin.build(self, *args, **kwargs)

    for method in (Mixin.build, layered):
        read = argument_reader(method)
        assert read(("c", {"m": 1}), {}, "model_kwargs") == {"m": 1}
        assert read(("c",), {"model_kwargs": 2}, "model_kwargs") == 2
        assert read(("c",), {}, "model_kwargs") is None
        assert read(("c",), {"logits_processor": 3}, "logits_processor") == 3
        assert read(("c",), {}, "not_a_parameter") is None
