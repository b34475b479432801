"""Our export against z-lab's own code (the `dflash` package's dflash/model.py, tests/helpers/zlab.py):
z-lab's DFlashDraftModel / DFlash2DraftModel.from_pretrained loads what export_drafter writes with 0
missing and 0 unexpected weights, and, in float32, gives the same draft logits, the same greedy selector
walk and the same candidate distributions q at T > 0 as our model; with a tiny Qwen3.5 target in the loop
(HF's qwen3_5 for theirs, our extract/ target for ours), their dflash_generate and our
speculative_generate emit the target's greedy tokens with the same accepted tokens per step.

Weights are rounded to bf16 before export (export writes bf16), so both sides hold identical values
and any difference is in the forward. Inputs are built the way dflash_generate builds its first draft:
the prompt's taps concatenated per token as target_hidden [1, T, K*H], the block [anchor, MASK x S]
embedded with the target's embeddings times input_embedding_scale, positions 0..T+B-1.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.helpers.drafter import tiny_config, tiny_model_and_head
from tests.helpers.zlab import zlab_reference
from train.checkpoint.export import export_drafter
from train.eval.config import SamplingConfig
from train.eval.speculative import ChainProposer, plain_generate, speculative_generate

SLIDING, FULL = "sliding_attention", "full_attention"
NUM_CTX = 12  # context tokens before the anchor: past every sliding window below
DFLASH2 = dict(arch="dflash2", conv_group_size=8, selector_rank=4, selector_top_k=8)
CASES = {
    "dflash1": dict(num_layers=2, block_size=4),
    "dflash1-sliding": dict(num_layers=3, layer_types=[SLIDING, SLIDING, FULL], sliding_window=5, block_size=6),
    "dflash2-block8-causal": dict(
        **DFLASH2,
        block_size=8,
        layer_types=[SLIDING, FULL],
        sliding_window=6,
        input_embedding_scale=1.5,
        output_multiplier=0.75,
        final_logit_softcapping=3.0,
    ),
    "dflash2-block16-bidirectional": dict(
        **DFLASH2, block_size=16, layer_types=[SLIDING, SLIDING], sliding_window=10, is_causal=False
    ),
    "dflash2-block8-projected": dict(**DFLASH2, block_size=8, context_width=8, context_projection="crc32 0badc0de"),
}
TOLERANCE = 1e-4  # float32, different reduction orders (their SDPA, our attention)


def bf16_exact(model: torch.nn.Module) -> torch.nn.Module:
    """Round every parameter and buffer to a bf16 value (kept float32): the export then loses nothing."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.copy_(t.bfloat16().float())
    return model.eval()


def projection_exact_in_bf16(cfg) -> torch.Tensor:
    """A [R, K*H] whose fold fc' A is bf16-exact: each row picks one input, scaled by a power of two."""
    A = torch.zeros(cfg.context_width, cfg.num_taps * cfg.hidden_size)
    for r in range(cfg.context_width):
        A[r, (11 * r + 3) % A.shape[1]] = 2.0 ** (r % 3 - 1)
    return A


def drafter(case: str):
    """A tiny float32 drafter of the case with every part active (DFlash 2's convolutions and selector
    random, not their inert start), bf16-exact, and the target head it drafts through."""
    cfg = tiny_config(**CASES[case])
    model, head = tiny_model_and_head(cfg, seed=1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_conv." in name or "candidate_selector.hidden_projection" in name:
                p.copy_(0.3 * torch.randn_like(p))
        if cfg.context_width is not None:
            model.context_projection.copy_(projection_exact_in_bf16(cfg))
    return bf16_exact(model), head, cfg


def load_theirs(zm, cfg, path):
    cls = zm.DFlash2DraftModel if cfg.is_dflash2 else zm.DFlashDraftModel
    theirs, info = cls.from_pretrained(str(path), output_loading_info=True, dtype=torch.float32)
    return theirs.eval(), info


def block_inputs(cfg, head, anchor: int = 7):
    g = torch.Generator().manual_seed(5)
    ctx_TKH = torch.randn(NUM_CTX, cfg.num_taps, cfg.hidden_size, generator=g)
    block_B = torch.tensor([anchor] + [cfg.mask_token_id] * (cfg.block_size - 1))
    return ctx_TKH, block_B


def both_forwards(zm, case, tmp_path):
    """(ours, theirs, head, cfg, ctx, block, our hidden [B, H], their hidden [B, H]) for one case."""
    model, head, cfg = drafter(case)
    export_drafter(model, cfg, tmp_path / "drafter")
    theirs, info = load_theirs(zm, cfg, tmp_path / "drafter")
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    assert info["mismatched_keys"] == set() and not info["error_msgs"], info
    ctx_TKH, block_B = block_inputs(cfg, head)
    pos = torch.arange(NUM_CTX + cfg.block_size)
    scale = cfg.input_embedding_scale if cfg.is_dflash2 else 1.0
    with torch.no_grad():
        ours_BH = model.forward_block(ctx_TKH, pos[:NUM_CTX], head.embed(block_B), pos[NUM_CTX:])
        theirs_BH = theirs(
            position_ids=pos[None],
            noise_embedding=head.embed(block_B)[None] * scale,
            target_hidden=ctx_TKH.flatten(1)[None],
        )[0]
    return model, theirs, head, cfg, ctx_TKH, block_B, ours_BH, theirs_BH


def their_head(head):
    return lambda hidden: hidden @ head.lm_head_VH.T


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("case", list(CASES))
def test_zlab_loads_our_export_and_drafts_the_same_logits_and_walk(case, tmp_path):
    zm = zlab_reference()
    model, theirs, head, cfg, _, block_B, ours_BH, theirs_BH = both_forwards(zm, case, tmp_path)
    with torch.no_grad():
        ours_BV = model.draft_logits(ours_BH, head)
        theirs_BV = theirs.compute_logits(theirs_BH, their_head(head))
        assert max_diff(ours_BV, theirs_BV) < TOLERANCE, f"max abs diff {max_diff(ours_BV, theirs_BV)}"
        ours_path = model.greedy_drafts(ours_BH[1:], head, block_B[0])
        if cfg.is_dflash2:
            theirs_path = theirs.propose(theirs_BH[None, 1:], block_B[:1], their_head(head), 0.0)[0][0]
            argmaxes = ours_BV[1:].argmax(-1)
            assert not torch.equal(ours_path, argmaxes), "the selector must change the walk, or this checks nothing"
        else:
            theirs_path = theirs_BV[1:].argmax(-1)
    assert ours_path.tolist() == theirs_path.tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_the_training_forward_is_zlabs_forward_block_by_block(case, tmp_path):
    """What is trained is what z-lab runs: our packed training forward (two sequences, seeded blocks, the
    block attention layout) gives, block by block, their forward over that block's sequence context
    strictly before its anchor."""
    from tests.helpers.drafter import batch_blocks, make_batch
    from train.drafter.attention import BlockAttentionLayout

    zm = zlab_reference()
    model, head, cfg = drafter(case)
    export_drafter(model, cfg, tmp_path / "drafter")
    theirs, _ = load_theirs(zm, cfg, tmp_path / "drafter")
    batch = make_batch([20, 28], 48, 4, cfg.num_taps, cfg.hidden_size, seed=2)
    blocks = batch_blocks(
        batch,
        num_blocks=6,
        block_size=cfg.block_size,
        mask_token_id=cfg.mask_token_id,
        generator=torch.Generator().manual_seed(3),
    )
    layout = BlockAttentionLayout.for_drafter(cfg, num_ctx=48, num_blocks=6)
    layout.update(blocks.seq_start_N, blocks.anchor_N)
    taps_TKH, pos_T = batch["hidden_TKH"], batch["position_ids_T"].long()
    scale = cfg.input_embedding_scale if cfg.is_dflash2 else 1.0
    with torch.no_grad():  # a projected drafter trains on its cache's codes
        ours_NBH = model(
            model.context_of_taps(taps_TKH), pos_T, head.embed(blocks.block_ids_NB), blocks.block_pos_NB, layout
        )
        checked = 0
        for n in blocks.block_valid_N.nonzero()[:, 0].tolist():
            start, anchor = int(blocks.seq_start_N[n]), int(blocks.anchor_N[n])
            theirs_BH = theirs(
                position_ids=torch.cat([pos_T[start:anchor], blocks.block_pos_NB[n]])[None],
                noise_embedding=head.embed(blocks.block_ids_NB[n])[None] * scale,
                target_hidden=taps_TKH[start:anchor].flatten(1)[None],
            )[0]
            assert max_diff(ours_NBH[n], theirs_BH) < TOLERANCE, (
                f"block {n}: max abs diff {max_diff(ours_NBH[n], theirs_BH)}"
            )
            checked += anchor - start > max(cfg.sliding_window or 0, 1)
    assert checked > 0, "no block had a context longer than the window"


@pytest.mark.parametrize("case", ["dflash1-sliding", "dflash2-block8-causal", "dflash2-block16-bidirectional"])
def test_sampled_drafts_have_zlabs_distributions(case, tmp_path):
    """At T > 0 every slot's q (DFlash 2: softmax of the selector's K scores / T given the token drawn
    before it, whatever top-k and top-p; DFlash 1: the serving distribution of the slot's logits) is
    z-lab's for the same slot."""
    zm = zlab_reference()
    model, theirs, head, cfg, ctx_TKH, block_B, _, theirs_BH = both_forwards(zm, case, tmp_path)
    # top-k 5 < K = 8 and top-p 0.9 shape the target's (and DFlash 1's) distribution, never the selector's.
    sampling = SamplingConfig(temperature=0.7, top_k=5, top_p=0.9)
    proposal = ChainProposer(model, head, context_dtype=None)(
        ctx_TKH, int(block_B[0]), sampling, torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        logits_SV = theirs.compute_logits(theirs_BH[1:], their_head(head))
        for s, q in enumerate(proposal.q):
            if cfg.is_dflash2:  # their walk for one slot, from the token our walk drew before it
                predecessor = torch.tensor([int(block_B[0]) if s == 0 else proposal.tokens[s - 1]])
                _, ids, probs = theirs.candidate_selector.select(
                    theirs_BH[None, 1 + s : 2 + s], logits_SV[None, s : s + 1], predecessor, sampling.temperature
                )
                want_V = torch.zeros(cfg.vocab_size).index_add_(0, ids[0, 0], probs[0, 0])
            else:
                want_V = zm._sampling_probs(logits_SV[s], sampling.temperature, sampling.top_p, sampling.top_k)
            got_V = q.dense(cfg.vocab_size)
            assert max_diff(got_V, want_V) < 1e-5, f"slot {s}: max abs diff {max_diff(got_V, want_V)}"
            assert got_V[proposal.tokens[s]] > 0


# ---- the target in the loop ------------------------------------------------------------------------
NEW_TOKENS = 40
PROMPT = [5, 6, 7, 8, 9, 10]
WRONG_EVERY = 5  # the selector's chain takes a wrong successor after every 5th token id


@pytest.fixture(scope="module")
def bigram_target(tmp_path_factory):
    """A tiny Qwen3.5 target whose token mixers are off (mixer_scale 0): its greedy next token is a
    function of the current token alone, the table `next_of` [V]."""
    from transformers import AutoModelForCausalLM

    from tools.fixtures.tiny_target import write_random_checkpoint

    zlab_reference()  # before building the target, which only their generate needs
    path = write_random_checkpoint(tmp_path_factory.mktemp("zlab") / "target", dtype=torch.float32, mixer_scale=0.0)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        next_of = hf(torch.arange(hf.config.vocab_size)[:, None]).logits[:, -1].argmax(-1)
    return path, hf, next_of


def chain_drafter(next_of: torch.Tensor, head):
    """A DFlash 2 drafter whose greedy walk follows the target's table `next_of`, except after token ids
    divisible by WRONG_EVERY: the selector's rank is the vocabulary, predecessor codebook 8 I, successor
    codebook the table's one-hot columns, hidden projection ~1 on the MASK slots' state (layers scaled
    down so that state barely moves) and unary logits scaled by 1/64. Acceptance then varies per step."""
    vocab = next_of.shape[0]
    cfg = tiny_config(
        **DFLASH2 | dict(selector_rank=vocab, selector_top_k=vocab),
        hidden_size=64,
        intermediate_size=96,
        head_dim=16,
        vocab_size=vocab,
        mask_token_id=vocab - 1,
        tap_layer_ids=[1, 3, 5],
        num_target_layers=8,
        block_size=8,
        output_multiplier=1 / 64,
    )
    model, _ = tiny_model_and_head(cfg, seed=2)
    successor = torch.where(torch.arange(vocab) % WRONG_EVERY == 0, (next_of + 1) % vocab, next_of)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(0.01)
        selector = model.candidate_selector
        selector.predecessor_codebook.copy_(8 * torch.eye(vocab))
        selector.successor_codebook.copy_(torch.nn.functional.one_hot(successor, vocab).T.float())
        mask_state_H = model.norm(head.embed(torch.tensor(cfg.mask_token_id)))
        selector.hidden_projection.weight.copy_((mask_state_H / mask_state_H.square().sum()).expand(vocab, -1))
    return bf16_exact(model), cfg


def test_zlab_generate_with_our_export_matches_our_speculative_decoding(bigram_target, tmp_path, monkeypatch):
    """Greedy, prompt PROMPT: z-lab's dflash_generate (HF's qwen3_5 target, their drafter from our export)
    and our speculative_generate (our target, our drafter) both emit plain greedy decoding's tokens, with
    the same tokens per verify step."""
    from tools.cli.verifier import TargetVerifier
    from train.drafter.model import TargetHead

    zm = zlab_reference()
    # Their stats time with torch.cuda.synchronize; only the acceptance lengths are wanted here, on CPU.
    monkeypatch.setattr(zm, "_cuda_time", time.perf_counter)
    path, hf, next_of = bigram_target
    verifier = TargetVerifier(path, [1, 3, 5], "cpu", torch.float32)
    head = TargetHead(verifier.embed_tokens_VH, verifier.lm_head_VH)
    model, cfg = chain_drafter(next_of, head)
    export_drafter(model, cfg, tmp_path / "drafter")
    theirs, _ = load_theirs(zm, cfg, tmp_path / "drafter")

    stats = zm.dflash_generate(theirs, hf, torch.tensor([PROMPT]), NEW_TOKENS, None, return_stats=True)
    ours = speculative_generate(ChainProposer(model, head, context_dtype=None), verifier, PROMPT, NEW_TOKENS)
    plain = plain_generate(verifier, PROMPT, NEW_TOKENS)

    assert stats.output_ids[0, len(PROMPT) :].tolist() == ours.tokens == plain.tokens
    assert stats.acceptance_lengths == ours.step_tokens
    assert 1 < min(ours.step_tokens[:-1]) and max(ours.step_tokens) == cfg.block_size > min(ours.step_tokens), (
        f"tokens per step {ours.step_tokens}: a drafter accepting none, or all, would check little"
    )
