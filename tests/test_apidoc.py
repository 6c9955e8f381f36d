"""docs/api.md is what `python -m autoshard.apidoc` writes from the docstrings, so it cannot go stale."""
from pathlib import Path

from autoshard import apidoc

ROOT = Path(__file__).resolve().parents[1]


def test_api_page_is_up_to_date():
    current = apidoc.API_PAGE.read_text(encoding="utf-8")
    assert current == apidoc.render(), "docs/api.md is out of date: run `python -m autoshard.apidoc` and commit it"


def test_api_page_has_a_section_per_module_and_every_public_name():
    text = apidoc.API_PAGE.read_text(encoding="utf-8")
    for name in apidoc.documented_modules():
        assert f"\n## {name}\n" in text
    assert "### `parallelize(model, mesh=None, example_inputs=None," in text
    assert "#### `Plan.table(self, rows=None) -> str`" in text
    assert "#### property `Plan.fingerprint`" in text


def test_readme_and_tutorial_link_the_api_page():
    assert "docs/api.md" in (ROOT / "README.md").read_text(encoding="utf-8")
    assert "api.md" in (ROOT / "docs" / "tutorial.md").read_text(encoding="utf-8")
