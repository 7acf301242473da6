"""The model's dropout (bert_packed/model/dropout.py): torch's F.dropout outside host_dropout(); inside
it, CPU masks from raw random bits with the same keep probability, scaling and gradient."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bert_packed.model import dropout as dropout_module
from bert_packed.model.dropout import Dropout, dropout, host_dropout, uses_host_masks
from helpers import count_raw_bit_masks

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def test_outside_the_context_it_is_torchs_dropout_draw_for_draw():
    x = torch.randn(64, 33)
    torch.manual_seed(3)
    ours = dropout(x, 0.1, True)
    torch.manual_seed(3)
    torch.testing.assert_close(ours, F.dropout(x, 0.1, True), rtol=0, atol=0)
    torch.manual_seed(3)
    torch.testing.assert_close(Dropout(0.1)(x), ours, rtol=0, atol=0)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keeps_each_element_with_probability_one_minus_p_and_scales_it(p):
    torch.manual_seed(0)
    n = 400_001  # odd: the last 64-bit draw is half used
    x = torch.rand(n) + 0.5
    with host_dropout():
        y = dropout(x, p, True)
    kept = y != 0
    fraction = kept.double().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(fraction - (1 - p)) < 5 * sigma, (fraction, 1 - p)
    torch.testing.assert_close(y[kept], x[kept] / (1 - p), rtol=1e-6, atol=0)
    # torch's own masks differ (a different draw), so this is not F.dropout in disguise
    torch.manual_seed(0)
    assert not torch.equal(F.dropout(x, p, True) != 0, kept)


def test_neighbouring_elements_are_independent():
    """Two elements share one 64-bit draw: their masks must not be correlated (p = 0.5: both
    kept a quarter of the time), and the mask has no pattern along the tensor."""
    torch.manual_seed(1)
    with host_dropout():
        kept = (dropout(torch.ones(1_000_000), 0.5, True) != 0).double().view(-1, 2)
    both = (kept[:, 0] * kept[:, 1]).mean().item()
    assert abs(both - 0.25) < 5 * math.sqrt(0.25 * 0.75 / kept.shape[0])
    halves = kept.view(2, -1).mean(dim=1)
    assert torch.all((halves - 0.5).abs() < 0.005), halves


def test_backward_multiplies_by_the_same_mask():
    torch.manual_seed(2)
    x = torch.randn(8, 16, 24, requires_grad=True)
    grad = torch.randn(8, 16, 24)
    with host_dropout():
        y = dropout(x, 0.2, True)
    y.backward(grad)
    mask = (y != 0).float() / 0.8
    torch.testing.assert_close(x.grad, grad * mask, rtol=1e-6, atol=0)
    torch.testing.assert_close(y, x.detach() * mask, rtol=1e-6, atol=0)


def test_bf16_stays_bf16_and_seeds_repeat():
    x = torch.randn(32, 48).bfloat16()
    with host_dropout():
        torch.manual_seed(4)
        a = dropout(x, 0.1, True)
        torch.manual_seed(4)
        b = dropout(x, 0.1, True)
        c = dropout(x, 0.1, True)
    assert a.dtype == torch.bfloat16 and a.shape == x.shape
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("p, training", [(0.0, True), (1.0, True), (0.3, False)])
def test_edges_are_torchs(p, training):
    x = torch.randn(10, 10)
    with host_dropout():
        assert not uses_host_masks(x, p, training)
        torch.testing.assert_close(dropout(x, p, training), F.dropout(x, p, training), rtol=0, atol=0)


def test_only_cpu_tensors_and_eager_code_use_raw_bits(monkeypatch):
    with host_dropout():
        assert uses_host_masks(torch.ones(2), 0.1, True)
        assert not uses_host_masks(torch.ones(2, device="meta"), 0.1, True)
        monkeypatch.setattr(dropout_module, "_compiling", lambda: True)
        assert not uses_host_masks(torch.ones(2), 0.1, True)
    with host_dropout(False):
        monkeypatch.undo()
        assert not uses_host_masks(torch.ones(2), 0.1, True)
    assert not uses_host_masks(torch.ones(2), 0.1, True)  # the context restored the default


def test_the_flag_is_per_thread():
    import threading

    seen = []
    with host_dropout():
        worker = threading.Thread(target=lambda: seen.append(uses_host_masks(torch.ones(2), 0.1, True)))
        worker.start()
        worker.join()
        seen.append(uses_host_masks(torch.ones(2), 0.1, True))
    assert seen == [False, True]


def test_inplace_module_keeps_torchs_inplace_dropout():
    x = torch.ones(100)
    with host_dropout():
        torch.manual_seed(5)
        y = Dropout(0.5, inplace=True)(x)
    assert y is x and set(np.unique(x.numpy()).tolist()) <= {0.0, 2.0}


def test_attention_dropout_goes_through_it(monkeypatch):
    """dense_attend's attention-probability dropout uses the same function (counted)."""
    from bert_packed.model.attention import dense_attend

    calls = count_raw_bit_masks(monkeypatch)
    q = k = v = torch.randn(2, 3, 8, 4)
    mask = torch.zeros(2, 1, 8, 8)
    with host_dropout():
        dense_attend(q, k, v, mask, dropout_p=0.1, training=True)
    assert calls == [torch.Size([2, 3, 8, 8])]
