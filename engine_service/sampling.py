"""Sampling: turn one step's logits into one token per sequence, batched and deterministic.

Contract
--------
- ``SamplingParams`` is a request's resolved settings (model defaults already applied);
  ``validate`` raises ``ValueError`` with the reason for any out-of-range value.
- ``Sampler.sample(logits, rows)`` takes fp32 logits ``[B, vocab]`` and one ``SampleRow``
  per logits row; it returns one ``Sampled`` per row. Order of processing, per row:
  1. repetition penalty (HF semantics: every token seen in prompt + output; positive
     logits divided, negative multiplied), then presence/frequency penalties (OpenAI
     semantics: output tokens only, ``- presence * [count > 0] - frequency * count``);
  2. while fewer than ``min_tokens`` tokens were generated, EOS and stop ids are banned;
  3. ``temperature == 0`` -> greedy (argmax; ties go to the lowest id);
     otherwise divide by temperature, keep the ``top_k`` best, the smallest set whose
     probability reaches ``top_p``, and tokens with probability >= ``min_p`` x the best
     one's, then draw from the row's own ``torch.Generator``.
- Reproducibility: each request owns a generator seeded from its ``seed`` (or a random
  seed); one draw per generated token consumes it, so a seeded request yields the same
  tokens whatever else shares its batches (given equal logits).
- Logprobs (when ``logprobs > 0``) are the model's raw distribution (``log_softmax`` of the
  logits before penalties and temperature): the chosen token's logprob plus the top
  ``logprobs`` alternatives, ties by lower id.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 0  # 0: up to the context limit
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the first invalid setting."""
        def bad(name: str, value: object, why: str) -> None:
            raise ValueError(f"invalid sampling.{name}={value!r}: {why}")

        if not (self.temperature >= 0.0) or self.temperature != self.temperature or self.temperature > 100.0:
            bad("temperature", self.temperature, "must be in [0, 100]")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", self.top_p, "must be in (0, 1]")
        if self.top_k < -1:
            bad("top_k", self.top_k, "must be >= 1, or 0/-1 to disable")
        if not (0.0 <= self.min_p <= 1.0):
            bad("min_p", self.min_p, "must be in [0, 1]")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            bad("presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            bad("frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        if not (0.0 < self.repetition_penalty <= 100.0):
            bad("repetition_penalty", self.repetition_penalty, "must be > 0 (1 = off)")
        if self.max_tokens < 0:
            bad("max_tokens", self.max_tokens, "must be >= 1 (0 = up to the context limit)")
        if self.min_tokens < 0 or (self.max_tokens and self.min_tokens > self.max_tokens):
            bad("min_tokens", self.min_tokens, f"must be in [0, max_tokens={self.max_tokens}]")
        if not (0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", self.logprobs, f"must be in [0, {MAX_LOGPROBS}]")
        for t in self.stop_token_ids:
            if not (0 <= t < vocab_size):
                bad("stop_token_ids", t, f"token id outside the vocabulary [0, {vocab_size})")
        if self.seed is not None and not (0 <= self.seed < 2**64):
            bad("seed", self.seed, "must be in [0, 2^64)")


@dataclass
class SampleRow:
    """One logits row: the request's settings and history."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    generator: torch.Generator | None  # required unless greedy
    eos_ids: frozenset[int] = frozenset()
    prompt_seen: torch.Tensor | None = None  # optional cached [vocab] bool mask of the prompt's ids


@dataclass
class Sampled:
    token_id: int
    logprob: float | None = None  # chosen token's raw logprob (when asked for)
    top: list[tuple[int, float]] = field(default_factory=list)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A generator seeded from ``seed`` (or a random 63-bit seed)."""
    g = torch.Generator(device=device)
    g.manual_seed((seed if seed is not None else secrets.randbits(63)) % (2**63))
    return g


class Sampler:
    """Stateless batched sampler (the per-request state lives in ``SampleRow``)."""

    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[Sampled]:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        logits = logits.float()
        vocab = logits.shape[1]
        want_lp = [i for i, r in enumerate(rows) if r.params.logprobs > 0]
        raw_lp = torch.log_softmax(logits[want_lp], dim=-1) if want_lp else None

        x = logits.clone()
        self._apply_penalties(x, rows)
        self._ban_until_min_tokens(x, rows, vocab)

        tokens = [0] * len(rows)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        if greedy:
            picked = torch.argmax(x[greedy], dim=-1).tolist()
            for i, t in zip(greedy, picked):
                tokens[i] = int(t)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            for i, t in zip(sampled, self._draw(x[sampled], [rows[i] for i in sampled])):
                tokens[i] = t

        out = [Sampled(token_id=t) for t in tokens]
        if raw_lp is not None:
            for j, i in enumerate(want_lp):
                lp = raw_lp[j]
                out[i].logprob = float(lp[tokens[i]])
                k = rows[i].params.logprobs
                vals, ids = _topk_stable(lp, k)
                out[i].top = [(int(t), float(v)) for t, v in zip(ids.tolist(), vals.tolist())]
        return out

    # -- steps ---------------------------------------------------------------------------
    @staticmethod
    def _apply_penalties(x: torch.Tensor, rows: Sequence[SampleRow]) -> None:
        vocab = x.shape[1]
        for i, r in enumerate(rows):
            p = r.params
            if p.repetition_penalty != 1.0:
                if r.prompt_seen is not None:
                    mask = r.prompt_seen.clone()
                    seen = torch.tensor(list(r.output_ids), dtype=torch.long, device=x.device)
                else:
                    mask = torch.zeros(vocab, dtype=torch.bool, device=x.device)
                    seen = torch.tensor([*r.prompt_ids, *r.output_ids], dtype=torch.long, device=x.device)
                mask[seen] = True
                row = x[i]
                pen = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                x[i] = torch.where(mask, pen, row)
            if (p.presence_penalty or p.frequency_penalty) and len(r.output_ids):
                out = torch.tensor(list(r.output_ids), dtype=torch.long, device=x.device)
                counts = torch.bincount(out, minlength=vocab).to(x.dtype)
                x[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)

    @staticmethod
    def _ban_until_min_tokens(x: torch.Tensor, rows: Sequence[SampleRow], vocab: int) -> None:
        for i, r in enumerate(rows):
            if len(r.output_ids) < r.params.min_tokens:
                banned = [t for t in (*r.eos_ids, *r.params.stop_token_ids) if 0 <= t < vocab]
                if banned:
                    x[i, banned] = float("-inf")

    def verify(self, logits: torch.Tensor, row: SampleRow, draft: Sequence[int]) -> list[Sampled]:
        """Speculative acceptance of ``draft`` against ``logits`` ``[len(draft) + 1, vocab]`` (row ``j``:
        the model's next-token logits after the request's tokens and ``draft[:j]``): the accepted
        drafts, then one token of the model's own, as ``sample`` would have chosen them one by one.

        Each row is processed as ``sample`` processes it (penalties and min_tokens with the drafts
        before it in the history). Greedy: a draft is kept while it equals the argmax. Sampling: the
        drafter is greedy (its distribution a point mass on its token), so draft ``d`` is kept with
        probability p(d) and otherwise replaced by a draw from p without ``d`` — standard
        speculative rejection sampling, whose output distribution is exactly p. A request's
        generator makes it reproducible, though its tokens differ from a non-speculative run's."""
        if logits.dim() != 2 or logits.shape[0] != len(draft) + 1:
            raise ValueError(f"logits {tuple(logits.shape)} do not match a draft of {len(draft)} tokens")
        p, out = row.params, []
        if (p.greedy and p.logprobs == 0 and not (p.presence_penalty or p.frequency_penalty)
                and p.repetition_penalty == 1.0 and len(row.output_ids) >= p.min_tokens):
            # nothing changes a row's logits: every row's argmax in one host read (the loop below
            # reads each row's, one sync per row); the same tokens (argmax ties: the first index)
            best = torch.argmax(logits.float(), dim=-1).tolist()
            for j, tok in enumerate(best):
                out.append(Sampled(token_id=int(tok)))
                if j == len(draft) or tok != draft[j]:
                    break
            return out
        history = list(row.output_ids)
        raw_lp = torch.log_softmax(logits.float(), dim=-1) if p.logprobs > 0 else None
        for j in range(len(draft) + 1):
            r = SampleRow(p, row.prompt_ids, history, row.generator, row.eos_ids, row.prompt_seen)
            x = logits[j : j + 1].float().clone()
            self._apply_penalties(x, [r])
            self._ban_until_min_tokens(x, [r], x.shape[1])
            d = draft[j] if j < len(draft) else None
            if p.greedy:
                tok = int(torch.argmax(x[0]))
            else:
                assert r.generator is not None, "a sampled row needs its request's generator"
                probs = self._probs(x, [r])[0]
                u = float(torch.rand(1, generator=r.generator, device=r.generator.device))
                if d is not None and u < float(probs[d]):
                    tok = d
                else:
                    if d is not None:
                        probs[d] = 0.0
                    tok = int(torch.multinomial(probs, 1, generator=r.generator))
            smp = Sampled(token_id=tok)
            if raw_lp is not None:
                smp.logprob = float(raw_lp[j, tok])
                vals, ids = _topk_stable(raw_lp[j], p.logprobs)
                smp.top = [(int(t), float(v)) for t, v in zip(ids.tolist(), vals.tolist())]
            out.append(smp)
            if tok != d:
                break
            history.append(tok)
        return out

    @staticmethod
    def _probs(x: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        """The distribution ``_draw`` draws from, per row over the whole vocabulary ``[B, vocab]``."""
        probs, ids = Sampler._filtered(x, rows)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        return torch.zeros_like(probs).scatter_(1, ids, probs)

    @staticmethod
    def _filtered(x: torch.Tensor, rows: Sequence[SampleRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """Temperature, top-k, top-p and min-p applied: (probabilities, token ids), best first."""
        temps = torch.tensor([r.params.temperature for r in rows], dtype=x.dtype, device=x.device)
        x = x / temps[:, None]
        sorted_logits, sorted_ids = torch.sort(x, dim=-1, descending=True, stable=True)
        vocab = x.shape[1]
        ranks = torch.arange(vocab, device=x.device)[None, :]
        ks = torch.tensor([r.params.top_k if r.params.top_k > 0 else vocab for r in rows], device=x.device)
        drop = ranks >= ks[:, None]
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        top_p = torch.tensor([r.params.top_p for r in rows], dtype=x.dtype, device=x.device)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly better tokens
        drop |= before >= top_p[:, None]
        min_p = torch.tensor([r.params.min_p for r in rows], dtype=x.dtype, device=x.device)
        drop |= probs < (min_p * probs[:, 0])[:, None]
        drop[:, 0] = False  # the best token always survives
        return probs.masked_fill(drop, 0.0), sorted_ids

    @staticmethod
    def _draw(x: torch.Tensor, rows: Sequence[SampleRow]) -> list[int]:
        probs, sorted_ids = Sampler._filtered(x, rows)
        picked: list[int] = []
        for j, r in enumerate(rows):
            assert r.generator is not None, "a sampled row needs its request's generator"
            idx = int(torch.multinomial(probs[j], 1, generator=r.generator))
            picked.append(int(sorted_ids[j, idx]))
        return picked


def _topk_stable(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``k`` of a 1-D tensor, ties broken by the lower index."""
    vals, ids = torch.sort(values, descending=True, stable=True)
    return vals[:k], ids[:k]
