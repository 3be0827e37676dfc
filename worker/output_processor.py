"""From sampled tokens to what callers see: stop conditions, streamed text, RequestOutput.

The engine appends each sampled token to its request and asks ``check_stop``; text is
streamed through the request's incremental detokenizer, holding back the tail that might
still turn into a stop string (streamed text is never taken back).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvmesh.worker.outputs import RequestOutput
from kvmesh.worker.request import Request, RequestStatus


class OutputProcessor:
    """Stop rules and output assembly for one engine (its EOS ids, length limit, tiers)."""

    def __init__(self, eos_token_ids: Iterable[int], max_model_len: int, tier_names: list[str]):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.tier_names = list(tier_names)  # below the device, fastest first

    def check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        """The finished status ``tok`` (just appended) gives ``req``, or None to go on."""
        p = req.params
        if p.stop and req.detokenizer is not None:
            text = req.detokenizer.text
            # a new match can only start in the held-back tail or in this token's text
            tail_from = max(0, len(req.text) - max(map(len, p.stop)) + 1)
            hits = [(at, s) for s in p.stop if (at := text.find(s, tail_from)) >= 0]
            if hits:
                # the earliest match wins; emit_text cuts the text there (req.text is what
                # was streamed so far: the tail held back until now is still to be sent)
                req.stop_reason = min(hits)[1]
                return RequestStatus.FINISHED_STOPPED
        if tok in p.stop_token_ids:
            req.stop_reason = tok
            return RequestStatus.FINISHED_STOPPED
        if not p.ignore_eos and tok in self.eos_token_ids:
            req.stop_reason = tok
            return RequestStatus.FINISHED_STOPPED
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def emit_text(self, req: Request) -> str:
        """The text to stream now. While a request with stop strings runs, the last
        ``max(len(stop)) - 1`` characters are held back: they may turn out to start a stop
        string, and streamed text is never taken back."""
        det = req.detokenizer
        if det is None:
            return ""
        if req.status.finished and isinstance(req.stop_reason, str):
            # stopped by a stop string: the match check_stop found, from the same place
            s, p = req.stop_reason, req.params
            at = det.text.find(s, max(0, len(req.text) - max(map(len, p.stop)) + 1))
            final = det.text[: at + len(s) if p.include_stop_str_in_output else at]
        elif req.status.finished:
            final = det.text
        else:
            keep_back = max(map(len, req.params.stop)) - 1 if req.params.stop else 0
            final = det.text[: max(len(req.text), len(det.text) - keep_back)]
        delta = final[len(req.text) :]
        req.text = final
        return delta

    def cached_by_tier(self, req: Request) -> dict[str, int]:
        """Prompt tokens served per tier, every tier of this engine named (0 when none)."""
        out = {"device": 0}
        out.update((name, 0) for name in self.tier_names)
        out.update(req.cached_by_tier)
        return out

    def output(self, req: Request, new_ids: list[int], delta: str) -> RequestOutput:
        finished = req.status.finished
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            text=req.text,  # everything streamed so far; the final text once finished
            new_token_ids=new_ids,
            new_text=delta,
            finished=finished,
            finish_reason=req.status.value if finished else None,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            cached_tokens_by_tier=self.cached_by_tier(req),
            logprobs=list(req.logprobs) if req.params.logprobs else None,
            top_logprobs=list(req.top_logprobs) if req.params.top_logprobs else None,
            stop_reason=req.stop_reason,
            ttft_s=(req.first_token_time - req.arrival_time) if req.first_token_time else None,
            error=req.error,
        )
