"""The hint format: parsing, JSON files, globs, per-tensor checks, and constrain's spec strings."""
import json

import pytest

from autoshard.frontend.constrain import parse_spec, spec_text
from autoshard.frontend.hints import (
    MAX_HINT_FILE_BYTES,
    Hints,
    check_placement_for,
    match_paths,
    unknown_target_error,
)
from autoshard.ir.errors import HintError
from autoshard.ir.placement import P, R, S

EXAMPLE = {
    "layers.*.attn.[qkv].weight": {"tp": "S(0)"},
    "layers.*.mlp:output": {"dp": "S(0)", "tp": "R"},
    "input:1": {"dp": "S(0)"},
    "layers.0:shard": {"in_strategy": [[2, 1], [1, 1]]},
    "layers.1:stage": 1,
}


def test_parse_kinds_and_placements():
    hints = Hints.parse(EXAMPLE)
    kinds = [(e.target_kind, e.pattern) for e in hints.entries]
    assert kinds == [("param", "layers.*.attn.[qkv].weight"), ("output", "layers.*.mlp"), ("input", "1"),
                     ("shard", "layers.0"), ("stage", "layers.1")]
    assert hints.entries[1].placements == {"dp": S(0), "tp": R}
    assert hints.entries[3].split_counts == ((2, 1), (1, 1))
    assert hints.entries[4].split_counts == (1,)
    assert hints.axis_names() == {"dp", "tp"}
    assert bool(hints) and not Hints.parse(None) and not Hints.parse({})


def test_parse_is_idempotent_and_json_round_trips():
    hints = Hints.parse(EXAMPLE)
    assert Hints.parse(hints) is hints
    data = {k: v for k, v in EXAMPLE.items() if not k.endswith(":stage")}
    assert Hints.parse(data).to_json() == data
    assert json.loads(json.dumps(Hints.parse(data).to_json())) == data


def test_placement_spellings():
    hints = Hints.parse({"w": {"a": " S( -1 ) ", "b": "P", "c": "R"}})
    assert hints.entries[0].placements == {"a": S(-1), "b": P, "c": R}


def test_load_reads_json(tmp_path):
    path = tmp_path / "hints.json"
    path.write_text(json.dumps(EXAMPLE))
    assert Hints.load(path).entries == Hints.parse(EXAMPLE).entries
    assert Hints.load(str(path)).entries == Hints.parse(EXAMPLE).entries


def test_load_limits_size(tmp_path):
    path = tmp_path / "big.json"
    path.write_text("{" + " " * MAX_HINT_FILE_BYTES + "}")
    with pytest.raises(HintError, match=r"big.json' is \d+ bytes; the limit is 4194304 \(4 MiB\)\. Use globs"):
        Hints.load(path)


@pytest.mark.parametrize("pattern, expected", [
    ("layers.*.w", ["layers.0.w", "layers.1.w"]),
    ("layers.[01].w", ["layers.0.w", "layers.1.w"]),
    ("layers.1.*", ["layers.1.w", "layers.1.b"]),
    ("*.b", ["layers.1.b"]),
    ("layers.0.w", ["layers.0.w"]),
    ("layers.2.w", []),
])
def test_match_paths(pattern, expected):
    assert match_paths(pattern, ["layers.0.w", "layers.1.w", "layers.1.b"]) == expected


def test_unknown_target_suggests_close_names():
    entry = Hints.parse({"layers.0.atn.q.weight": {"tp": "S(0)"}}).entries[0]
    error = unknown_target_error(entry, ["layers.0.attn.q.weight", "wte.weight"], "parameter")
    assert "Did you mean 'layers.0.attn.q.weight'?" in str(error)
    assert "model.named_parameters()" in str(error)
    error = unknown_target_error(entry, ["completely.different"], "parameter")
    assert "Did you mean" not in str(error)


def test_check_placement_for():
    assert check_placement_for("k", "param", "tp", S(-1), (4, 6)) == S(1)
    assert check_placement_for("k", "output", "tp", P, (4, 6)) == P
    with pytest.raises(HintError, match=r"hint 'k' for w, on axis 'tp': S\(2\) names dim 2, but the parameter has "
                                        r"2 dims \(shape \(4, 6\)\); use 'S\(0\)' \.\. 'S\(1\)' or 'R'"):
        check_placement_for("k", "param", "tp", S(2), (4, 6), "w")
    with pytest.raises(HintError, match=r"S\(-3\) names dim -3"):
        check_placement_for("k", "input", "tp", S(-3), (4, 6))
    with pytest.raises(HintError, match=r"use 'R' \(a scalar has no dim to shard\)"):
        check_placement_for("k", "output", "tp", S(0), ())
    with pytest.raises(HintError, match=r"an input cannot be partial \('P'\).*use 'R' or 'S\(d\)'"):
        check_placement_for("input:0", "input", "dp", P, (4,))


def test_constrain_spec_strings():
    assert spec_text({"dp": "S(0)", "tp": R}) == "dp=S(0);tp=R"
    assert spec_text("tp = S(1) ; dp=P") == "tp=S(1);dp=P"
    assert parse_spec("dp=S(0);tp=R") == {"dp": S(0), "tp": R}


@pytest.mark.parametrize("spec, message", [
    ({}, r"spec is empty; map axis names to placements"),
    ({"dp": "Shard(0)"}, r"malformed placement 'Shard\(0\)' in autoshard.constrain axis 'dp': write 'S\(<dim>\)'"),
    ({0: "R"}, r"axis 0 is not a mesh axis name"),
    (["dp"], r"spec must be a dict \{axis: placement\}.*got list"),
    ("dp:S(0)", r"'dp:S\(0\)' in spec 'dp:S\(0\)' is not '<axis>=<placement>'"),
    ("dp=R;dp=S(0)", r"names axis 'dp' twice"),
    ("", r"names no axis"),
])
def test_constrain_spec_errors(spec, message):
    with pytest.raises(HintError, match=message):
        spec_text(spec)


def test_load_passes_parsed_hints_and_dicts_through(tmp_path):
    hints = Hints.parse(EXAMPLE)
    assert Hints.load(hints) is hints
    assert Hints.load(EXAMPLE).entries == hints.entries


def test_recompute_key_lists_module_paths_and_round_trips():
    hints = Hints.parse({"input:0": {"dp": "S(0)"}, "recompute": ["layers.0", "layers.1"]})
    assert hints.recompute == ["layers.0", "layers.1"] and not hints.zero
    assert Hints.parse(hints.to_json()).to_json() == hints.to_json()
    with pytest.raises(HintError, match=r"key 'recompute' must be a list of module paths"):
        Hints.parse({"recompute": "layers.*"})
