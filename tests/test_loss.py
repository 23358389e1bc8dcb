"""The loss module: the chunked cross entropy equals the plain one (loss and gradients, plain and
vocab-parallel on 2 gloo ranks, and the per-token entropy), keeps no ``[tokens, vocab]`` logits for backward, and the
engine's chunked path gives the default path's loss and gradients."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nxd_finetune.loss import (
    IGNORE_INDEX,
    ChunkedScores,
    ce_sum,
    chunk_rows,
    chunked_ce_sum,
    chunked_eval_stats,
    eval_stats,
    vocab_parallel_cross_entropy,
)

ROOT = Path(__file__).resolve().parents[1]
N, H, V = 300, 32, 1000


def _inputs(seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, nn.Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    head = nn.Linear(H, V, bias=False, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g) * 0.3)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[::7] = IGNORE_INDEX
    return hidden, head, targets


def _loss_and_grads(fn, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden, head, targets = _inputs(dtype=dtype)
    loss = fn(hidden, head, targets)
    loss.backward()
    return loss.detach(), hidden.grad, head.weight.grad


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 5e-6)])
def test_chunked_equals_plain_cross_entropy_and_its_gradients(dtype, tol):
    """Equal maths (float64: 1e-12); in fp32 the chunks change only the summation order of the
    head's matmuls (gradients within 5e-6 of their largest element, the loss within 1e-6)."""
    ref = _loss_and_grads(lambda h, head, t: F.cross_entropy(head(h), t, ignore_index=IGNORE_INDEX,
                                                              reduction="sum"), dtype)
    for rows in (1000, 64, 7):  # one chunk (the plain path), even chunks, a ragged last chunk
        got = _loss_and_grads(lambda h, head, t, r=rows: chunked_ce_sum(h, head, t, r), dtype)
        torch.testing.assert_close(got[0], ref[0], rtol=min(tol, 1e-6), atol=0)
        for a, b in zip(got[1:], ref[1:], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=tol * b.abs().max().item())
    hidden, head, targets = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(chunked_eval_stats(hidden, head, targets, 64),
                                   eval_stats(head(hidden), targets), rtol=1e-6, atol=0)


def test_chunked_loss_saves_no_full_vocabulary_logits():
    """What autograd keeps for backward: the plain loss holds ``[N, V]`` tensors, the chunked
    loss nothing larger than the inputs and one chunk's row of statistics."""
    def largest_saved(fn) -> int:
        hidden, head, targets = _inputs()
        sizes: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = fn(hidden, head, targets)
        loss.backward()
        return max(sizes)

    plain = largest_saved(lambda h, head, t: ce_sum(head(h), t))
    chunked = largest_saved(lambda h, head, t: chunked_ce_sum(h, head, t, 50))
    assert plain >= N * V
    assert chunked <= max(V * H, N * H)  # the head's weight and the hidden states; no [N, V]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cross_entropy_backward_holds_no_full_fp32_copies(dtype, monkeypatch):
    """``ce_sum``: the loss and the logits' gradient equal ``F.cross_entropy`` of their fp32 copy bit
    for bit, while autograd keeps only the logits as given (no fp32 copy, no log-probabilities) and
    neither pass makes an ``[N, V]`` tensor but the backward's gradient (a chunk of rows at a time):
    the fp32 copy, log-probabilities and their gradient, at once, were a QLoRA step's memory peak."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.storages: dict[int, int] = {}  # the bytes of each storage an op returned (a view: its base's)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return out

    import nxd_finetune.loss as loss_mod

    monkeypatch.setattr(loss_mod, "CE_CHUNK_BYTES", 32 * V * 4, raising=False)  # 32 rows, a ragged last
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(N, V, generator=g) * 4).to(dtype)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[::7] = IGNORE_INDEX
    ref_in = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_in.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    ref.backward(torch.tensor(0.37))
    got_in = logits.clone().requires_grad_()
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), Largest() as forward:
        loss = ce_sum(got_in, targets)
    assert torch.equal(loss, ref)
    forward.storages.pop(got_in.untyped_storage().data_ptr(), None)  # views of the logits
    assert max(forward.storages.values()) < logits.numel() * logits.element_size() // 4
    assert sum(saved) <= logits.numel() * logits.element_size() + targets.numel() * 8 + 64, saved
    with Largest() as mode:
        loss.backward(torch.tensor(0.37))
    assert torch.equal(got_in.grad, ref_in.grad)
    full = logits.numel() * logits.element_size()
    mode.storages.pop(got_in.untyped_storage().data_ptr())  # the saved logits (views of them)
    sizes = sorted(mode.storages.values())
    assert sizes[-1] == full and sizes[-2] < full // 4, sizes[-3:]


def test_auto_chunk_rows():
    assert chunk_rows(128256, "auto") == 523  # 256 MB of fp32 logits at Llama-3's vocabulary
    assert chunk_rows(2048, "auto") == 32768 and chunk_rows(2048, 100) == 100 and chunk_rows(2048, None) is None


def _vocab_parallel_worker() -> dict:
    import torch.distributed as dist

    from nxd_finetune.parallel.launch import init_distributed

    torch.set_num_threads(1)  # a forked child must not use the parent's OpenMP pool
    backend = init_distributed("gloo")
    rank, group = backend.rank, dist.new_group([0, 1])
    hidden, head, targets = _inputs()
    shard = nn.Linear(H, V // 2, bias=False)
    with torch.no_grad():
        shard.weight.copy_(head.weight[rank * V // 2:(rank + 1) * V // 2])
    loss = chunked_ce_sum(hidden, shard, targets, 64, group)
    loss.backward()
    plain = vocab_parallel_cross_entropy(shard(hidden.detach()), targets, group).sum()
    with torch.no_grad():
        stats = chunked_eval_stats(hidden, shard, targets, 64, group)
    entropy = ChunkedScores(hidden.detach(), shard, targets, 64, group).token_entropy(0.7)
    out = {"loss": loss.detach(), "plain": plain.detach(), "hidden_grad": hidden.grad, "stats": stats,
           "weight_grad": shard.weight.grad, "entropy": entropy}
    dist.destroy_process_group()
    return out


@pytest.mark.usefixtures("workers_tmpdir")
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_one_chunk_entropy_reuses_the_nll_logits(temperature):
    """A GRPO loss asks for the token log-probs, then the entropy: with one chunk of targets the
    entropy comes from the same logits (the output layer runs once, not twice), the same numbers
    (issue 44 item 9)."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(24, 16, requires_grad=True), torch.randn(40, 16)
    targets = torch.randint(0, 40, (24,))
    calls = []

    def head(h: torch.Tensor) -> torch.Tensor:
        calls.append(h.shape[0])
        return h @ weight.t()

    expected = ChunkedScores(hidden.detach(), head, targets, 64).token_entropy(temperature)
    calls.clear()
    scores = ChunkedScores(hidden, head, targets, 64, index=torch.arange(24))
    nll, _ = scores.token_nll(temperature)
    entropy = scores.token_entropy(temperature)
    assert calls == [24] and torch.equal(entropy, expected)
    nll.sum().backward()
    assert torch.equal(scores.token_entropy(temperature), expected) and calls == [24, 24]


def test_vocab_parallel_chunked_equals_the_full_vocabulary_loss():
    from nxd_finetune.parallel.launch import launch

    results = launch(_vocab_parallel_worker, 2, start_method="fork")
    ref_loss, ref_hidden_grad, ref_weight_grad = _loss_and_grads(
        lambda h, head, t: F.cross_entropy(head(h), t, ignore_index=IGNORE_INDEX, reduction="sum"))
    hidden, head, targets = _inputs()
    with torch.no_grad():
        ref_stats = eval_stats(head(hidden), targets)
        ref_entropy = torch.distributions.Categorical(logits=head(hidden) / 0.7).entropy()
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["entropy"], ref_entropy, rtol=1e-5, atol=1e-5)  # GRPO's entropy metric
        torch.testing.assert_close(r["loss"], ref_loss, rtol=1e-6, atol=0)
        torch.testing.assert_close(r["plain"], ref_loss, rtol=1e-6, atol=0)
        torch.testing.assert_close(r["stats"], ref_stats, rtol=1e-6, atol=0)
        # the hidden states' gradient is partial per vocab shard (the head's backward reduces it over tp)
        want = ref_weight_grad[rank * V // 2:(rank + 1) * V // 2]
        torch.testing.assert_close(r["weight_grad"], want, rtol=0, atol=5e-6 * ref_weight_grad.abs().max().item())
    torch.testing.assert_close(results[0]["hidden_grad"] + results[1]["hidden_grad"], ref_hidden_grad,
                               rtol=0, atol=5e-6 * ref_hidden_grad.abs().max().item())


def test_engine_chunked_path_equals_the_default(quickstart_cache, monkeypatch):
    """``training.loss_chunk_tokens`` on the quickstart model: the same loss and gradients as the
    default (one chunk), through ``Engine.forward_backward`` and ``eval_stats``."""
    from nxd_finetune.data.inputs import resolve_model_dir
    from nxd_finetune.objective import SFT
    from nxd_finetune.recipe import load_recipe
    from nxd_finetune.sft.engine import build_engine

    rec = load_recipe(ROOT / "recipes" / "quickstart.yaml", ["training.max_steps=2", "training.warmup_steps=0"])
    engine = build_engine(rec, resolve_model_dir(rec.model.path), torch.device("cpu"), 2)
    assert engine.loss_chunk_rows == 32768  # "auto" at vocab 2048: the plain path
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, engine.config.vocab_size, (2, 64), generator=g)
    labels = ids.clone()
    labels[:, :20] = IGNORE_INDEX
    batch = {"input_ids": ids, "labels": labels}
    import nxd_finetune.loss as loss_mod

    chunked_calls: list[int] = []
    real = loss_mod.chunked_ce_sum

    def counted(*args, **kwargs):
        chunked_calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(loss_mod, "chunked_ce_sum", counted)
    results = []
    for rows in (None, 16):
        engine.loss_chunk_rows = rows
        engine.optimizer.zero_grad(set_to_none=True)
        loss, _ = engine.forward_backward([batch], torch.tensor(88.0), SFT)
        grads = [p.grad.clone() for p in engine.trainable()]
        results.append((loss, grads, engine.eval_stats(batch, SFT)))
    assert chunked_calls == [1]  # the chunked path ran (with rows=16 only)
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=0)
    for a, b in zip(results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    torch.testing.assert_close(results[1][2], results[0][2], rtol=1e-6, atol=0)


def test_pipeline_scores_from_hidden_states_equal_full_logits():
    """The pipeline's last-stage scores from hidden states ``[B, T, H]`` (``hidden_scores``: the head
    run over target positions in chunks) give the supervised objective's loss of the full logits,
    with the same gradients, and its eval statistics equal :func:`eval_stats`."""
    from nxd_finetune.loss import LogitScores, ce_sum, eval_stats, hidden_scores, shift_labels
    from nxd_finetune.objective import SFT

    g = torch.Generator().manual_seed(3)
    head = torch.nn.Linear(16, 50, bias=False).double()
    hidden = torch.randn(2, 9, 16, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (2, 9), generator=g)
    labels[0, :4] = IGNORE_INDEX
    want = ce_sum(head(hidden), shift_labels(labels)) / 7.0
    gw = torch.autograd.grad(want, [hidden, head.weight])
    got = SFT.loss(hidden_scores(hidden, labels, head=head, rows=3), {"labels": labels})[0] / 7.0
    gg = torch.autograd.grad(got, [hidden, head.weight])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    for a, b in zip(gg, gw, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    full = LogitScores(head(hidden), shift_labels(labels))
    torch.testing.assert_close(SFT.loss(full, {"labels": labels})[0], want * 7.0, rtol=1e-12, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(SFT.eval_stats(hidden_scores(hidden, labels, head=head, rows=3), {"labels": labels}),
                                   eval_stats(head(hidden), shift_labels(labels)), rtol=1e-6, atol=0)


def test_target_rows_are_padded_to_few_shapes_with_ignored_targets():
    """``target_index`` pads the target rows to a multiple of ``TARGET_ROWS_MULTIPLE`` (at most
    every position) with ignored targets: the output layer's matmuls see a few shapes, not one per
    micro-batch (oneDNN caches primitives per shape), and the loss is the unpadded one."""
    from nxd_finetune.loss import IGNORE_INDEX, TARGET_ROWS_MULTIPLE, ce_sum, shift_labels, target_index

    g = torch.Generator().manual_seed(0)
    shapes = set()
    for n_prompt in range(1, 400, 7):
        labels = torch.randint(0, 50, (2, 256), generator=g)
        labels[:, :n_prompt] = IGNORE_INDEX
        index, targets = target_index(labels)
        real = shift_labels(labels).reshape(-1)
        kept = real != IGNORE_INDEX
        n = int(kept.sum())
        assert index.numel() == targets.numel() == min(512, -(-n // TARGET_ROWS_MULTIPLE) * TARGET_ROWS_MULTIPLE)
        assert torch.equal(index[:n], kept.nonzero().squeeze(1)) and torch.equal(targets[:n], real[kept])
        assert bool((targets[n:] == IGNORE_INDEX).all())
        logits = torch.randn(512, 50, generator=g)
        unpadded = ce_sum(logits[kept.nonzero().squeeze(1)], real[kept])
        torch.testing.assert_close(ce_sum(logits[index], targets), unpadded)
        shapes.add(index.numel())
    # 58 different target counts, at most 9 row counts (multiples of 64 up to 512, and 0 rows)
    assert len(shapes) <= 9, sorted(shapes)
