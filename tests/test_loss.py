"""The fused, chunked unembedding + cross-entropy equals the plain version, values and gradients."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mode.layers.loss import linear_cross_entropy

F64_TOL = 1e-12  # float64 throughout: only summation order differs
F32_TOL = 1e-5  # float32 inputs: chunked vs one-shot summation


def reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((hidden @ weight.t()).reshape(-1, weight.shape[0]), targets.reshape(-1))


@pytest.mark.parametrize("in_place", [True, False])  # the chunk GEMMs writing / adding in place, or not
@pytest.mark.parametrize("chunk_elements", [7 * 50, 2**26])  # several uneven chunks; one chunk
def test_matches_cross_entropy_values_and_gradients(chunk_elements: int, in_place: bool) -> None:
    hidden = torch.randn(3, 11, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (3, 11))
    got = linear_cross_entropy(hidden, weight, targets, chunk_elements=chunk_elements, gemms_in_place=in_place)
    (got * 2.5).backward()  # a non-unit upstream gradient must scale the saved gradients
    gh, gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    want = reference(hidden, weight, targets)
    (want * 2.5).backward()
    torch.testing.assert_close(got, want, rtol=F64_TOL, atol=F64_TOL)
    torch.testing.assert_close(gh, hidden.grad, rtol=F64_TOL, atol=F64_TOL)
    torch.testing.assert_close(gw, weight.grad, rtol=F64_TOL, atol=F64_TOL)


def test_no_grad_path_matches() -> None:
    hidden, weight = torch.randn(40, 8), torch.randn(64, 8)
    targets = torch.randint(0, 64, (40,))
    with torch.no_grad():
        got = linear_cross_entropy(hidden, weight, targets, chunk_elements=64 * 5)
    torch.testing.assert_close(got, reference(hidden, weight, targets), rtol=F32_TOL, atol=F32_TOL)


def test_model_loss_equals_cross_entropy_of_its_logits() -> None:
    from mode.config import config_from_dict
    from mode.model import LanguageModel

    cfg = config_from_dict({"model": {"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 64, "max_seq_len": 32},
                            "data": {"seq_len": 32}})
    model = LanguageModel(cfg).double()
    tokens = torch.randint(0, 256, (2, 33))
    out = model(tokens[:, :-1], tokens[:, 1:])
    logits = model(tokens[:, :-1]).logits
    torch.testing.assert_close(out.lm_loss, F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()),
                               rtol=F64_TOL, atol=F64_TOL)


@pytest.mark.parametrize("grad", [True, False])
def test_a_confidently_wrong_prediction_costs_its_full_loss(grad: bool) -> None:
    """A target 200 logits below the row's largest has a float32 probability that underflows to 0:
    its loss is still about 200 nats (log-softmax), as F.cross_entropy's, not a capped -log(tiny) = 87.3."""
    hidden = torch.tensor([[1.0, 0.0], [0.0, 1.0]], requires_grad=grad)
    weight = torch.tensor([[200.0, 0.0], [0.0, 0.0], [0.0, 3.0]], requires_grad=grad)
    targets = torch.tensor([1, 2])  # row 0: target logit 0 against 200; row 1: the most likely token
    with torch.set_grad_enabled(grad):
        got = linear_cross_entropy(hidden, weight, targets)
    want = reference(hidden.detach(), weight.detach(), targets)
    assert got.item() > 99.0  # row 0 alone costs 200 nats: the mean is above 100 - rounding
    torch.testing.assert_close(got, want, rtol=F32_TOL, atol=F32_TOL)
    if grad:
        got.backward()
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        reference(h, w, targets).backward()
        torch.testing.assert_close(hidden.grad, h.grad, rtol=F32_TOL, atol=F32_TOL)
        torch.testing.assert_close(weight.grad, w.grad, rtol=F32_TOL, atol=F32_TOL)
