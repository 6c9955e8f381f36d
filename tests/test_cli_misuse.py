"""Misused entry points, one message each: factories and loss functions; and the command line's exit
codes: 0 ok, 1 mismatch, 2 bad input, 3 could not run.

The factories below are loaded by name (`test_cli_misuse:<name>`; tests/ is on sys.path, see conftest.py)."""
import json

import pytest
import torch
from torch import nn

import autoshard.__main__ as cli
import autoshard.verify.verify
from autoshard import ExportError, UserInputError, parallelize
from autoshard.__main__ import BAD_INPUT, COULD_NOT_RUN, MISMATCH, OK, main
from autoshard.frontend.factory import make_case
from autoshard.runtime.launch import RanksFailed
from autoshard.zoo import mlp


def _small():
    return mlp(batch=4, in_dim=8, hidden=8, out_dim=8, n_layers=2)


def returns_a_string():
    return "gpt2"


def returns_a_model_name():
    return "gpt2", _small()[1]


def returns_the_model_alone():
    return _small()[0]


def returns_four_items():
    return (*_small(), 0.1)


def returns_inputs_first():
    model, inputs, _ = _small()
    return inputs, model


def returns_a_loss_name():
    model, inputs, _ = _small()
    return model, inputs, "mse"


def returns_a_non_tensor_input():
    model, inputs, loss_fn = _small()
    return model, (inputs[0], {"mask": None}), loss_fn


def returns_a_one_argument_loss():
    model, inputs, _ = _small()
    return model, inputs, lambda outputs: outputs.mean()


def raises():
    raise FileNotFoundError("weights.safetensors")


def small():
    return _small()


def no_float64():
    """A model whose op has no float64 kernel on CPU (grouped matmul, as in mixture-of-experts layers)."""
    torch.manual_seed(0)
    return Experts(), (torch.randn(8, 8),), lambda out, x: out.pow(2).mean()


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 8, 8) / 3)
        self.register_buffer("offs", torch.tensor([4, 8], dtype=torch.int32))

    def forward(self, x):
        return torch._grouped_mm(x, self.w, offs=self.offs)


# --- the factory loader: one message per misuse -----------------------------------------------------------


def test_factory_returning_a_string():
    with pytest.raises(UserInputError, match=r"(?s)factory 'test_cli_misuse:returns_a_string' returned a str "
                                             r"\('gpt2'\), not a tuple; it must return \(model, example_inputs\) or "
                                             r"\(model, example_inputs, loss_fn\), e\.g\. `return model, \(x,\), "
                                             r"loss_fn`\nWhere: File .*test_cli_misuse\.py\", line \d+, in "
                                             r"returns_a_string"):
        make_case("test_cli_misuse:returns_a_string")


def test_factory_returning_a_name_instead_of_the_model():
    """The user-reported case: this used to fail with AttributeError: 'str' object has no attribute 'double'."""
    with pytest.raises(UserInputError, match=r"(?s)factory 'test_cli_misuse:returns_a_model_name' returned \(str, "
                                             r"tuple\): item 0 must be the model, a torch\.nn\.Module \(or an "
                                             r"fx\.GraphModule\), but is a str \('gpt2'\); return \(model, "
                                             r"example_inputs\) or \(model, example_inputs, loss_fn\)\nWhere: "):
        make_case("test_cli_misuse:returns_a_model_name")


def test_factory_returning_the_model_alone():
    with pytest.raises(UserInputError, match=r"returned the model alone \(MLP\); return it with its example inputs: "
                                             r"\(model, example_inputs\) or \(model, example_inputs, loss_fn\)"):
        make_case("test_cli_misuse:returns_the_model_alone")


def test_factory_returning_four_items():
    with pytest.raises(UserInputError, match=r"returned 4 items \(MLP, tuple, function, float\); expected \(model, "
                                             r"example_inputs\) or \(model, example_inputs, loss_fn\)"):
        make_case("test_cli_misuse:returns_four_items")


def test_factory_returning_the_items_in_the_wrong_order():
    with pytest.raises(UserInputError, match=r"returned \(tuple, MLP\): item 0 must be the model, a torch\.nn\.Module "
                                             r"\(or an fx\.GraphModule\), but is a tuple of 1 item \(item 1 is an "
                                             r"nn\.Module: are the items in the wrong order\?\); return \(model, "):
        make_case("test_cli_misuse:returns_inputs_first")


def test_factory_returning_a_loss_that_is_not_callable():
    with pytest.raises(UserInputError, match=r"returned \(MLP, tuple, str\): item 2 must be the loss function "
                                             r"loss_fn\(outputs, \*example_inputs\) -> scalar tensor, but is a str "
                                             r"\('mse'\)"):
        make_case("test_cli_misuse:returns_a_loss_name")


def test_factory_returning_an_input_that_is_not_a_tensor():
    with pytest.raises(UserInputError, match=r"factory 'test_cli_misuse:returns_a_non_tensor_input': "
                                             r"example_inputs\[1\] is of type dict \(\{'mask': None\}\), not a "
                                             r"torch\.Tensor"):
        make_case("test_cli_misuse:returns_a_non_tensor_input")


def test_factory_returning_a_loss_of_the_wrong_arity():
    with pytest.raises(UserInputError, match=r"factory 'test_cli_misuse:returns_a_one_argument_loss': loss_fn "
                                             r"<lambda>\(outputs\) takes 1 positional argument, but autoshard calls it "
                                             r"as loss_fn\(outputs, \*example_inputs\)"):
        make_case("test_cli_misuse:returns_a_one_argument_loss")


def test_factory_that_raises():
    with pytest.raises(UserInputError, match=r"(?s)factory 'test_cli_misuse:raises' raised FileNotFoundError: "
                                             r"weights\.safetensors\nWhere: .*in raises\nWhat to do: fix the factory"):
        make_case("test_cli_misuse:raises")


def test_factory_spec_errors():
    with pytest.raises(UserInputError, match=r"factory 'test_cli_misuse' must look like MODULE:FACTORY"):
        make_case("test_cli_misuse")
    with pytest.raises(UserInputError, match=r"cannot import module 'no_such_module' of factory"):
        make_case("no_such_module:f")
    with pytest.raises(UserInputError, match=r"'test_cli_misuse' has no callable 'nothing'"):
        make_case("test_cli_misuse:nothing")


# --- loss functions: checked on their signature before tracing, on their value while tracing ----------------

SMALL = mlp(batch=8, in_dim=8, hidden=16, out_dim=8)


def _one_argument_loss(out):
    return out.pow(2).mean()


def test_loss_fn_with_the_wrong_arity():
    """The user-reported case: loss_fn(outputs) used to surface as an export failure blaming the inputs."""
    with pytest.raises(UserInputError, match=r"(?s)loss_fn _one_argument_loss\(out\) takes 1 positional argument, but "
                                             r"autoshard calls it as loss_fn\(outputs, \*example_inputs\) with 2 "
                                             r"arguments: the model's outputs, then the 1 example input; give it the "
                                             r"parameters \(outputs, x0\), or \(outputs, \*inputs\) to ignore the "
                                             r"inputs\nWhere: File .*test_cli_misuse\.py\", line \d+, in "
                                             r"_one_argument_loss"):
        parallelize(SMALL[0], mesh=(2,), example_inputs=SMALL[1], loss_fn=_one_argument_loss)


def test_loss_fn_needing_more_arguments():
    with pytest.raises(UserInputError, match=r"loss_fn <lambda>\(out, x, target\) needs 3 positional arguments, but "
                                             r"autoshard calls it .* with 2 arguments.*; give the extra parameters "
                                             r"defaults or pass those values as example inputs"):
        parallelize(SMALL[0], mesh=(2,), example_inputs=SMALL[1], loss_fn=lambda out, x, target: out.sum())


def test_loss_fn_with_a_required_keyword():
    with pytest.raises(UserInputError, match=r"loss_fn <lambda>\(out, x, \*, target\) requires keyword argument\(s\) "
                                             r"\['target'\], which are never passed"):
        parallelize(SMALL[0], mesh=(2,), example_inputs=SMALL[1], loss_fn=lambda out, x, *, target: out.sum())


@pytest.mark.parametrize("loss_fn, message", [
    (lambda out, x: out * 2, r"loss_fn <lambda> returned a tensor of shape \(8, 8\), not a scalar; reduce it to one "
                             r"number, e\.g\. with \.mean\(\) or \.sum\(\)"),
    (lambda out, x: 3.0, r"loss_fn <lambda> returned a float \(3\.0\), not a tensor; compute the loss with torch "
                         r"operations"),
    (lambda out, x: (out.mean(), out), r"loss_fn <lambda> returned a tuple of 2 items; return only the loss"),
    (lambda out, x: (out > 0).sum(), r"loss_fn <lambda> returned a torch\.int64 scalar; the loss must be floating "
                                     r"point"),
], ids=["non-scalar", "float", "tuple", "integer"])
def test_loss_fn_returning_no_scalar_tensor(loss_fn, message):
    with pytest.raises(UserInputError, match=rf"(?s){message}.*\nWhere: File .*test_cli_misuse\.py"):
        parallelize(SMALL[0], mesh=(2,), example_inputs=SMALL[1], loss_fn=loss_fn)


def _loss_of_a_dict(out, x):
    return out.logits.mean()


def test_loss_fn_that_fails_is_named():
    with pytest.raises(ExportError, match=r"(?s)could not trace the loss function _loss_of_a_dict: AttributeError: .*"
                                          r"Where: File .*test_cli_misuse\.py\", line \d+, in _loss_of_a_dict: return "
                                          r"out\.logits\.mean\(\).*What to do: autoshard calls "
                                          r"loss_fn\(outputs, \*example_inputs\)"):
        parallelize(SMALL[0], mesh=(2,), axis_names=("dp",), example_inputs=SMALL[1], loss_fn=_loss_of_a_dict)


# --- exit codes through main([...]) ---------------------------------------------------------------------------

VERIFY = ["verify", "--mesh", "2", "--axis-names", "dp", "--simulate", "--steps", "1"]


def test_exit_0_when_verify_agrees(capsys):
    assert main([*VERIFY, "test_cli_misuse:small"]) == OK
    assert capsys.readouterr().out.startswith("verify: OK (1 steps, float64, tolerance 1e-06)")


def test_exit_1_on_a_mismatch(monkeypatch):
    real_rank_run = autoshard.verify.verify.rank_run

    def wrong_rank_0(module, *args, **kwargs):  # rank 0 starts from other weights: a wrong program
        if module.rank == 0:
            with torch.no_grad():
                dict(module.named_local_parameters())["layers.0.weight"].mul_(1.01)
        return real_rank_run(module, *args, **kwargs)

    monkeypatch.setattr(autoshard.verify.verify, "rank_run", wrong_rank_0)
    assert main([*VERIFY, "test_cli_misuse:small"]) == MISMATCH


@pytest.mark.parametrize("factory", ["returns_a_string", "returns_a_one_argument_loss", "raises"])
def test_exit_2_on_a_misused_factory(factory, capsys):
    assert main([*VERIFY, f"test_cli_misuse:{factory}"]) == BAD_INPUT
    assert capsys.readouterr().err.startswith(f"autoshard: error: factory 'test_cli_misuse:{factory}'")


def test_exit_2_for_a_model_without_float64_kernels_says_to_pass_dtype(capsys):
    assert main([*VERIFY, "test_cli_misuse:no_float64"]) == BAD_INPUT
    err = capsys.readouterr().err
    assert "autoshard: error: the model Experts cannot run in float64, verify's default: RuntimeError: " in err
    assert "verify --dtype float32 (or bfloat16" in err and "Traceback" not in err


def test_exit_3_when_a_rank_crashes(monkeypatch, capsys):
    def crash(module, *args, **kwargs):
        raise RuntimeError("segfault-like crash in the rank")

    monkeypatch.setattr(autoshard.verify.verify, "rank_run", crash)
    assert main([*VERIFY, "test_cli_misuse:small"]) == COULD_NOT_RUN
    err = capsys.readouterr().err
    assert "autoshard: could not run: RuntimeError: simulated rank 0 failed: RuntimeError: segfault-like crash" in err


def test_exit_3_when_ranks_fail_or_time_out(monkeypatch, capsys):

    def ranks_failed(*args, **kwargs):
        raise RanksFailed("2 of 2 ranks failed; rank 1 reported nothing 4 s after the first failure", {}, {}, [1])

    monkeypatch.setattr(cli, "verify_factory", ranks_failed)  # the name the CLI calls
    assert main(["verify", "test_cli_misuse:small", "--mesh", "2"]) == COULD_NOT_RUN
    assert capsys.readouterr().err.startswith("autoshard: could not run: 2 of 2 ranks failed")


def test_verify_dtype_float32_reports_its_tolerances_in_json(capsys):
    assert main([*VERIFY, "test_cli_misuse:small", "--dtype", "float32", "--json"]) == OK
    report = json.loads(capsys.readouterr().out)
    assert report["dtype"] == "float32" and report["tolerance"] is None
    assert report["tolerance_rule"].startswith("10 x max(own noise, eps) per tensor")
    eps = torch.finfo(torch.float32).eps
    for kind in ("loss", "outputs", "grads", "params"):
        assert report["tolerances"][kind] == pytest.approx(10 * max(report["noise"][kind], eps))
        assert report["max_rel_diff"][kind] <= report["tolerances"][kind]


def test_verify_rejects_an_unknown_dtype(capsys):
    with pytest.raises(SystemExit) as info:
        main([*VERIFY, "test_cli_misuse:small", "--dtype", "float16"])
    assert info.value.code == BAD_INPUT and "invalid choice: 'float16'" in capsys.readouterr().err
