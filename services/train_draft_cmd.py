"""`upesi train-draft`: trains an EAGLE-style head for a target by self-distillation.

1. The target answers a prompt set (chat template, in-process engine, batched).
2. Teacher forcing over prompt + answer gives the target's last hidden states at every position; the head's features
   are those after the final norm (what the LM head reads, as in EAGLE-1; the default) or before it.
3. The reduced draft vocab is the N most frequent tokens of that text; the head learns to predict the next feature
   (smooth L1) and the target's next-token distribution over the reduced vocab (cross-entropy on soft targets), over
   --unroll passes: pass j reads the features pass j - 1 predicted, as draft step j does (its own predictions).
4. Held-out prompts give the mean accepted length with the trained head (greedy, K = 4) through the real engine.
Shapes: B = sequences in a batch, T = positions, D = hidden, N = reduced vocab.
"""
from __future__ import annotations

import argparse
import os
import random
import time
from dataclasses import dataclass

from shared.config import add_config_arguments, config_from_args, option
from services.draft_data import cached_features, coverage, read_prompts, reduced_vocab, training_answers
from shared.engine.config import check_dtype

DEFAULT_PROMPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                               "draft_prompts_large.txt")


@dataclass(slots=True)
class TrainDraftConfig:
    model: str | None = option(None, "target model: a .gguf file or a Hugging Face folder (default: SmolLM2-135M)")
    prompts: str = option(DEFAULT_PROMPTS, "prompt set, one prompt per line (several files: comma-separated, "
                                           "joined before the seeded shuffle)")
    out: str = option("models/eagle-head", "output folder: head.safetensors + eagle.json")
    held_out: int = option(24, "prompts kept for the acceptance figure")
    limit: int | None = option(None, "use only this many prompts of the set (after a seeded shuffle)")
    max_tokens: int = option(160, "answer length the target generates per prompt")
    draft_vocab: int = option(8192, "reduced draft vocab: the target's N most frequent tokens")
    epochs: int = option(3, "passes over the training sequences")
    batch_size: int = option(8, "sequences per optimiser step")
    lr: float = option(1e-3, "peak learning rate (AdamW, cosine decay)")
    cls_weight: float = option(1.0, "weight of the token cross-entropy beside the feature regression")
    num_threads: int | None = option(None, "torch CPU threads")
    seed: int = option(0, "shuffling and initialisation seed")
    dtype: str = option("float16", "dtype of the saved head (float16 or bfloat16)")
    init: str | None = option(None, "start from this trained head (same target; its id map and feature kind are kept)")
    post_norm: bool = option(True, "a new head reads features after the target's final norm (EAGLE-1's choice); "
                                   "false: before it, where a few huge dimensions make the regression much harder "
                                   "(held-out mean accepted length 1.45 against 1.68 on SmolLM2-135M)")
    unroll: int = option(2, "training passes per batch: pass j feeds the features pass j - 1 predicted (draft depth j)")
    answers_cache: str | None = option(None, "JSON-lines file of the target's answers: read what is there, append "
                                             "what is generated (an interrupted run resumes; a retrain skips step 1)")
    gen_batch: int = option(128, "prompts the target answers at once")
    features_cache: str | None = option(None, "file of the target's hidden states of the training sequences "
                                              "(torch.save): those of sequences already there are reused, the "
                                              "rest computed and added (a retrain skips step 2)")
    target_dtype: str = option("auto", "dtype the target answers and computes features in: auto = the services' "
                                       "default (bfloat16 on CPUs with native bf16: several times faster here, and "
                                       "the features the head then reads in serving)")
    train_dtype: str = option("auto", "compute dtype of the training passes (autocast; the weights and the optimiser "
                                      "stay fp32): float32, bfloat16, or auto (bfloat16 on CPUs with native bf16)")
    sampled_answers: int = option(0, "extra answers per training prompt, sampled at --sample-temperature (more and "
                                     "more varied training text)")
    first_sample_round: int = option(1, "seed round of the first sampled answer: rounds first .. first + N - 1 "
                                        "(a head retrained with --init can learn from answers it has not seen)")
    greedy_answers: bool = option(True, "train on the greedy answer of every prompt too (false: sampled ones only)")
    sample_temperature: float = option(0.8, "temperature of the sampled answers")
    answer_loss_only: bool = option(True, "count the loss only where the head drafts in serving: positions of the "
                                          "target's answer (the prompt stays in the attention context); false: "
                                          "every position, user text included")

    def __post_init__(self) -> None:
        if min(self.epochs, self.batch_size, self.draft_vocab, self.held_out, self.unroll) < 1:
            raise ValueError("epochs, batch_size, draft_vocab, held_out and unroll must be positive")
        check_dtype(self.target_dtype, what="target_dtype")
        check_dtype(self.train_dtype, ("auto", "float32", "bfloat16"), "train_dtype")   # autocast: bf16 or none
        if self.sampled_answers < 0 or self.sample_temperature <= 0 or self.first_sample_round < 1:
            raise ValueError("sampled_answers must be >= 0, sample_temperature positive and first_sample_round >= 1")
        if not self.greedy_answers and not self.sampled_answers:
            raise ValueError("no training text: greedy_answers is false and sampled_answers is 0")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, TrainDraftConfig)


def pair_masks(lens: list[int], firsts: list[int], t: int):
    """Masks over training pairs p < t of each sequence (pair p reads f_p, x_{p+1}) -> (valid, real), [B, T] bool:
    valid = the pair counts in the loss (firsts[b] <= p < lens[b]); real = its input feature stays the target's own
    in unrolled passes (p <= firsts[b]: the prompt's features, and the first answer pair's, are real in serving)."""
    import torch

    at = torch.arange(t)[None, :]                                                 # [1, T]
    first = torch.tensor(firsts)[:, None]                                         # [B, 1]
    return (at < torch.tensor(lens)[:, None]) & (at >= first), at <= first


def unrolled_passes(head, f_in, toks, lens: list[int], valid, prompt, unroll: int,
                    bf16: bool = False):
    """The head's training passes over a batch -> [(out [B, T, D] fp32, live [B, T] bool)], one per pass: the
    predicted features and the pairs that count. f_in [B, T, D]: the target's features of pairs (f_p, x_{p+1}),
    toks [B, T]: x_{p+1}; valid / prompt: pair_masks. Pass j is draft step j + 1 as serving runs it: from the
    answer on, pair p reads the feature pass j - 1 predicted at p - 1 (the head's own), paired with the real next
    token (as when the drafts so far were right). Each pass attends to its own pass's keys (HASS's aligned
    context measured worse here: docs/negative-results.md)."""
    import torch

    from shared.spec.eagle import causal_mask

    b, t, _ = f_in.shape
    pos = torch.arange(t).expand(b, -1)                                           # [B, T]
    mask = causal_mask([0] * b, lens, f_in.device)                                # [B, T, T]
    inp, passes = f_in, []
    for _ in range(unroll):
        if not valid.any():                                                      # no pair of the batch counts
            break
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out, _, _ = head(inp, toks, pos, None, mask)                         # [B, T, D]
        out = out.float()
        passes.append((out, valid))
        inp = torch.where(prompt[..., None], f_in, torch.cat([f_in[:, :1], out[:, :-1].detach()], dim=1))
    return passes


def train(head, seqs: list[list[int]], feats, cfg: TrainDraftConfig, starts: list[int] | None = None) -> None:
    """`starts[i]`: the first pair of sequence i that counts in the loss (pair p reads f_p, x_{p+1} and predicts
    f_{p+1}, x_{p+2}); None counts every pair."""
    import torch
    import torch.nn.functional as F
    from torch.nn.utils.rnn import pad_sequence
    from tqdm import tqdm

    from shared.engine.config import serving_dtype

    bf16 = serving_dtype(cfg.train_dtype, torch.device("cpu")) == "bfloat16"
    rng = random.Random(cfg.seed)
    order = list(range(len(seqs)))
    steps = cfg.epochs * ((len(order) + cfg.batch_size - 1) // cfg.batch_size)
    params = [p for n, p in head.named_parameters()]
    with torch.no_grad():
        feats = [head.features(f) for f in feats]                                # the head's feature space
    # A few feature dimensions are orders of magnitude larger than the rest (massive activations): the regression
    # compares features divided by each dimension's spread so that it does not see only those.
    scale = torch.cat(feats).std(0).clamp_min(1e-3)                              # [D]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=steps, pct_start=0.05)
    head.train()
    with tqdm(total=steps, desc="training head", unit="step") as bar:
        for _ in range(cfg.epochs):
            rng.shuffle(order)
            for s in range(0, len(order), cfg.batch_size):
                idx = order[s:s + cfg.batch_size]
                lens = [len(seqs[i]) - 1 for i in idx]                          # pairs (f_p, x_{p+1}), p < L - 1
                f_in = pad_sequence([feats[i][:-1] for i in idx], batch_first=True)      # [B, T, D]
                f_out = pad_sequence([feats[i][1:] for i in idx], batch_first=True)      # [B, T, D]
                toks = pad_sequence([torch.tensor(seqs[i][1:]) for i in idx], batch_first=True)   # [B, T]
                firsts = [0 if starts is None else starts[i] for i in idx]
                valid, prompt = pair_masks(lens, firsts, f_in.shape[1])
                with torch.no_grad():
                    teacher = head.logits(f_out[valid]).softmax(-1)              # [valid, N]
                reg = cls = 0.0
                for out, live in unrolled_passes(head, f_in, toks, lens, valid, prompt, cfg.unroll, bf16):
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                        logp = head.logits(out[live]).log_softmax(-1)            # [live, N] fp32
                    reg = reg + F.smooth_l1_loss(out[live] / scale, f_out[live] / scale)
                    cls = cls + -(teacher[live[valid]] * logp).sum(-1).mean()
                loss = reg + cfg.cls_weight * cls
                if not torch.is_tensor(loss):                                    # no pair of the batch counts
                    bar.update(1)
                    continue
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                sched.step()
                bar.set_postfix(reg=f"{reg.item():.3f}", cls=f"{cls.item():.3f}")
                bar.update(1)
    head.eval()


def acceptance(model: str | None, head_dir: str, prompts: list[list[int]], max_tokens: int, k: int
               ) -> tuple[float, bool]:
    """Mean accepted length (tokens per target verification step) with the head, greedy, each prompt alone (batch
    1, as the benchmark's headline: a step's draft-tree nodes are shared by the sequences it drafts for, so a batch
    of 24 would give each one node); and whether the speculative output equals plain greedy output."""
    from shared.engine.config import EngineConfig
    from shared.sampling_params import SamplingParams
    from shared.spec.factory import build_engine

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    eng = build_engine(EngineConfig(model=model, progress=False, kv_cache_gb=0.5, speculative=f"eagle:{head_dir}",
                                 num_speculative_tokens=k))
    verifications = 0
    propose = eng.proposer.propose

    def counting(seqs, ks):
        nonlocal verifications
        out = propose(seqs, ks)
        verifications += sum(1 for p in out if p.tokens)
        return out
    eng.proposer.propose = counting
    spec = [out for p in prompts for out in eng.generate([p], params)]
    eng.proposer = None
    plain = eng.generate(prompts, params)
    return (eng.stats_accepted + verifications) / max(1, verifications), spec == plain


def main(args: argparse.Namespace) -> None:
    import torch

    from shared.engine.config import EngineConfig, serving_dtype
    from shared.spec.eagle import EagleHead, head_config_for
    from shared.spec.factory import build_engine
    from shared.tokenizer import Tokenizer

    cfg = config_from_args(TrainDraftConfig, args)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    texts = read_prompts(cfg.prompts)
    if len(texts) <= cfg.held_out:
        raise ValueError(f"{cfg.prompts} has {len(texts)} prompts; need more than --held-out {cfg.held_out}")
    random.Random(cfg.seed).shuffle(texts)
    texts = texts[:cfg.limit]
    dtype = serving_dtype(cfg.target_dtype, torch.device("cpu"))
    engine = build_engine(EngineConfig(model=cfg.model, progress=False, kv_cache_gb=4.0, max_num_seqs=cfg.gen_batch,
                                    enable_prefix_caching=False, dtype=dtype))
    tok = Tokenizer(engine.model_path)
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    test_prompts, train_prompts = prompts[:cfg.held_out], prompts[cfg.held_out:]
    seq_prompts, answers = training_answers(engine, train_prompts, cfg)
    seqs = [p + a for p, a in zip(seq_prompts, answers)]
    feats = cached_features(engine, seqs, cfg.features_cache)
    mcfg = engine.model_cfg
    if cfg.init:
        head = EagleHead.load(cfg.init, torch.float32, torch.device("cpu"))
    else:
        head = EagleHead(head_config_for(mcfg, cfg.draft_vocab, cfg.post_norm))
        head.id_map = reduced_vocab([a for a in answers], cfg.draft_vocab, mcfg.vocab_size, mcfg.eos_token_ids)
    model = engine.runner.model
    head.attach_target(model.embed_tokens.weight.detach(), model.norm, model.lm_head.weight.detach())
    for p in model.norm.parameters():
        p.requires_grad_(False)
    del engine
    print(f"{len(seqs)} sequences, {sum(map(len, seqs))} tokens; reduced vocab covers "
          f"{coverage(answers, head.id_map):.1%} of answer tokens", flush=True)
    # In serving the first draft reads the pair (last prompt feature, first answer token): pair len(prompt) - 1.
    starts = [len(p) - 1 for p in seq_prompts] if cfg.answer_loss_only else None
    train(head, seqs, feats, cfg, starts)
    head.save(cfg.out, getattr(torch, cfg.dtype))
    size = os.path.getsize(os.path.join(cfg.out, "head.safetensors")) / 2**20
    print(f"saved {cfg.out} ({size:.1f} MiB) after {time.perf_counter() - t0:.0f} s", flush=True)
    tau, same = acceptance(cfg.model, cfg.out, test_prompts, cfg.max_tokens, 4)
    print(f"held-out ({len(test_prompts)} prompts, greedy, K = 4): mean accepted length {tau:.2f} tokens per "
          f"target step; speculative output equals greedy output: {same}; total {time.perf_counter() - t0:.0f} s")
