import pytest
import torch

from distillspec import (
    DistillSpecError,
    alpha_from_tvd,
    divergence,
    expected_tau,
    forward_kl,
    jsd,
    predicted_speedup,
    tvd,
)
from distillspec.training.divergences import compress_topk, reduce

NAMES = ["fkl", "rkl", "jsd", "tvd"]


@pytest.fixture
def logits():
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, 5, 11, generator=g) * 2, torch.randn(3, 5, 11, generator=g) * 2


@pytest.mark.parametrize("name", NAMES)
def test_zero_when_p_equals_q(logits, name):
    q, _ = logits
    assert float(divergence(name, q, q.clone())) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_positive_and_differentiable(logits, name):
    q, p = logits
    q = q.clone().requires_grad_(True)
    loss = divergence(name, q, p, temperature=1.5)
    loss.backward()
    assert loss.item() > 0 and q.grad is not None and torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0


def test_tvd_in_unit_interval(logits):
    q, p = logits
    values = tvd(q * 10, p * 10, reduction="none")
    assert (values >= 0).all() and (values <= 1).all()
    disjoint_p = torch.full((1, 1, 4), -1e4)
    disjoint_p[..., 0] = 0
    disjoint_q = torch.full((1, 1, 4), -1e4)
    disjoint_q[..., 3] = 0
    assert float(tvd(disjoint_q, disjoint_p)) == pytest.approx(1.0, abs=1e-6)


def test_jsd_over_beta_tends_to_fkl(logits):
    q, p = logits
    fkl = float(forward_kl(q, p))
    gaps = [abs(float(jsd(q, p, beta=b)) / b - fkl) for b in (0.1, 0.01, 0.001, 0.0001)]
    assert gaps == sorted(gaps, reverse=True) and gaps[-1] < 0.02 * fkl


def test_kl_matches_torch_reference(logits):
    q, p = logits
    ref = torch.nn.functional.kl_div(
        torch.log_softmax(q, -1), torch.log_softmax(p, -1), log_target=True, reduction="none"
    ).sum(-1)
    assert torch.allclose(forward_kl(q, p, reduction="none"), ref, atol=1e-5)


def test_mask_and_sequence_reduction(logits):
    q, p = logits
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    changed = q.clone()
    changed[0, 3:] += 5  # masked positions must not matter
    assert float(forward_kl(q, p, mask)) == pytest.approx(float(forward_kl(changed, p, mask)))
    values = forward_kl(q, p, reduction="none")
    seq = (values[0, :2].mean() + values[1].mean()) / 2  # Eq. 2: mean per sequence, empty rows left out
    assert float(forward_kl(q, p, mask, reduction="seq")) == pytest.approx(float(seq), rel=1e-5)
    assert float(reduce(values, mask, "token")) == pytest.approx(float(values[mask.bool()].mean()), rel=1e-5)


def test_alpha_and_tau_formulas(logits):
    q, p = logits
    assert alpha_from_tvd(q, p) == pytest.approx(1 - float(tvd(q, p, reduction="token")))
    assert alpha_from_tvd(p, p, temperature=0) == 1.0
    assert alpha_from_tvd(q, p.argmax(-1), temperature=0) == alpha_from_tvd(q, p, temperature=0)  # the target's ids
    assert expected_tau(1.0, 5) == 6.0
    assert expected_tau(0.0, 5) == 1.0
    assert expected_tau(0.8, 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    assert predicted_speedup(3.0, 0.1, 5) == pytest.approx(2.0)


def test_bad_divergence_and_beta(logits):
    q, p = logits
    with pytest.raises(DistillSpecError, match="divergence='kl2'"):
        divergence("kl2", q, p)
    with pytest.raises(DistillSpecError, match="beta"):
        jsd(q, p, beta=1.0)


@pytest.mark.parametrize("name", NAMES)
def test_topk_target_is_exact_at_full_k_and_a_lower_bound_below(logits, name):
    q, p = logits
    full = float(divergence(name, q, p, temperature=0.8))
    assert float(divergence(name, q, compress_topk(p, 11, temperature=0.8), temperature=0.8)) == pytest.approx(
        full, rel=1e-4
    )
    previous = 0.0
    for k in (1, 3, 6, 10):
        lumped = float(divergence(name, q, compress_topk(p, k, temperature=0.8), temperature=0.8))
        assert -1e-6 <= lumped <= full + 1e-5
        previous = max(previous, lumped)
    assert previous > 0.5 * full  # the top tokens carry most of the signal


def test_topk_target_is_differentiable_and_checks_temperature(logits):
    q, p = logits
    q = q.clone().requires_grad_(True)
    jsd(q, compress_topk(p, 4), beta=0.3).backward()
    assert torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0
    with pytest.raises(DistillSpecError, match="compressed at temperature 1.0"):
        tvd(q, compress_topk(p, 4), temperature=2.0)
    with pytest.raises(DistillSpecError, match="k=0"):
        compress_topk(p, 0)
