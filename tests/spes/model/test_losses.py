import pytest
import torch

from spes.model.losses import chunked_linear_cross_entropy, decayed_lb_factor, load_balance_loss, router_z_loss


def test_losses_exact_values():
    probs = torch.full((4, 2), 0.5)
    assert load_balance_loss(probs, torch.tensor([4, 4]), top_k=2).item() == pytest.approx(1.0)
    probs = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    assert load_balance_loss(probs, torch.tensor([2, 0]), top_k=1).item() == pytest.approx(2.0)
    assert load_balance_loss(probs, torch.tensor([2, 0]), 1, torch.tensor([0.7, 1.0])).item() == pytest.approx(1.4)
    assert router_z_loss(torch.zeros(3, 4)).item() == pytest.approx(torch.log(torch.tensor(4.0)).item() ** 2)


def test_decayed_lb_factor():
    assert decayed_lb_factor(0, 100) == 0.7 and decayed_lb_factor(10, 100) == pytest.approx(0.85)
    assert decayed_lb_factor(20, 100) == 1.0 and decayed_lb_factor(90, 100) == 1.0


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_the_chunked_loss_equals_the_plain_one_with_its_gradients(chunk):
    """chunked_linear_cross_entropy: the LM head and the loss chunk by chunk (logits recomputed in the
    backward) give the loss, the LM-head z-loss and every gradient of the plain path within fp32 rounding."""
    torch.manual_seed(0)
    N, D, V = 37, 16, 50
    y = torch.randint(0, V, (N,))
    y[3] = -100  # an unlabelled token counts for the z-loss, not the cross-entropy
    h0, w0 = torch.randn(N, D), torch.randn(V, D)

    def run(loss_fn):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        ce, z = loss_fn(h, w)
        (ce + 0.3 * z).backward()
        return ce.detach(), z.detach(), h.grad, w.grad

    def plain(h, w):
        logits = (h @ w.t()).float()
        return torch.nn.functional.cross_entropy(logits, y), torch.logsumexp(logits, -1).square().mean()

    want = run(plain)
    got = run(lambda h, w: chunked_linear_cross_entropy(h, w, y, chunk))
    for a, b in zip(got, want):  # within fp32 rounding of the largest value (sums over V and N are reordered)
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()
    with pytest.raises(ValueError, match="loss chunk must be >= 1"):
        chunked_linear_cross_entropy(h0, w0, y, 0)


def test_a_model_with_the_chunked_loss_trains_like_the_plain_one():
    import dataclasses

    from spes.model.transformer import CausalLM
    from tests.conftest import tiny_config

    cfg = tiny_config(lm_head_z_loss_coef=0.01)
    grads = []
    for impl in ("plain", "chunked"):
        torch.manual_seed(0)
        model = CausalLM(dataclasses.replace(cfg, loss_impl=impl, loss_chunk_tokens=10))
        x = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        out = model(x, x)
        out.loss.backward()
        grads.append((out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
        assert (out.logits is None) == (impl == "chunked")
    (loss_a, ga), (loss_b, gb) = grads
    assert torch.allclose(loss_a, loss_b, rtol=1e-6)
    for n in ga:
        assert (ga[n] - gb[n]).abs().max() <= 1e-5 * gb[n].abs().max(), n
