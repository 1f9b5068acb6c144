"""The batch API: ``LLM(model=...).generate(prompts, SamplingParams(...))`` (vLLM style)."""

from __future__ import annotations

import numbers
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvpage.engine.chat import render_chat_prompt
from kvpage.engine.engine import LLMEngine
from kvpage.engine.params import RequestOutput, SamplingParams
from kvpage.engine.vllm_compat import LLM_NOT_IMPLEMENTED, check_not_implemented
from kvpage.errors import RequestRejected


class LLM:
    """Offline generation on the paged KV cache.

    Args:
        model: ``"stories260K"`` (bundled), a Hugging Face model folder, or an
            in-memory ``transformers`` model.
        **kwargs: the rest of :class:`kvpage.engine.config.EngineConfig` (block_size,
            num_blocks, kv_cache_memory_bytes, max_num_seqs, max_num_batched_tokens,
            max_model_len, enable_prefix_caching, kv_cache_dtype, backend, dtype, seed,
            device, num_threads). ``num_threads`` (default None = 1 thread; 0 = keep
            torch's current setting) calls ``torch.set_num_threads`` (process-wide):
            on a small or shared CPU, 1 is often much faster for the bundled model
            (see docs/user-guide.md, "Threads").

    One ``generate``/``chat`` runs at a time per LLM: a call while another thread's
    call is running raises ``RuntimeError`` (the engine's request ids and steps are not
    shared between callers); use one LLM per thread, or ``kvpage serve``.

    Attributes:
        llm_engine: the underlying :class:`LLMEngine`.
    """

    def __init__(self, model: Any = "stories260K", **kwargs: Any) -> None:
        check_not_implemented("LLM", LLM_NOT_IMPLEMENTED, kwargs)
        self._attach(LLMEngine.from_config(model=model, **kwargs))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """An LLM over an engine built already (``LLMEngine.from_config``)."""
        llm = cls.__new__(cls)
        llm._attach(engine)
        return llm

    def _attach(self, engine: LLMEngine) -> None:
        self.llm_engine = engine
        self._counter = 0
        self._busy = threading.Lock()  # one generate at a time (see the class docstring)

    @property
    def tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_tokenizer(self) -> Any:
        """The model's tokenizer, as vLLM's ``LLM.get_tokenizer``: for a Hugging Face
        folder the ``transformers`` tokenizer itself (``encode``, ``decode``,
        ``apply_chat_template``, ...); otherwise kvpage's tokenizer
        (``encode(text, bos=True)``, ``decode(ids)``; the bundled llama2.c tokenizer has
        no chat template); None for a model without one."""
        tok = self.llm_engine.tokenizer
        return getattr(tok, "hf", tok)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's ``LLM.get_default_sampling_params``: ``SamplingParams`` with the
        model's generation_config.json defaults (temperature, top_p, top_k, min_p,
        repetition_penalty, max_new_tokens as max_tokens; see
        ``EngineConfig.generation_config``), or plain ``SamplingParams()`` when it
        gives none. ``generate``/``chat`` use it when ``sampling_params`` is None."""
        return SamplingParams(**self.llm_engine.default_sampling_params)

    def get_metrics(self) -> dict[str, float]:
        """The engine's ``kvpage:*`` metrics (see ``LLMEngine.get_metrics``)."""
        return self.llm_engine.get_metrics()

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (vLLM's ``LLM.chat``).

        Each conversation is rendered by
        :func:`kvpage.engine.chat.render_chat_prompt`: ``chat_template`` if given, else
        the model's Jinja chat template (transformers' sandboxed renderer; the prompt
        ids equal ``tokenizer.apply_chat_template(..., tokenize=True)``), else — for a
        model without one, like the bundled stories260K — kvpage's plain
        ``"{role}: {content}\n"`` template ending in ``"assistant:"``. Then generated
        as in :meth:`generate`; each output's ``prompt`` is the rendered text.

        Args:
            messages: a list of ``{"role", "content"}`` dicts (a Jinja template also
                takes ``name``, ``tool_calls``, ``tool_call_id``), or a list of such lists.
            sampling_params: as in :meth:`generate`.
            use_tqdm: as in :meth:`generate`.
            chat_template: a Jinja template string to use instead of the model's.
            chat_template_kwargs: extra template variables.
            add_generation_prompt: end with the assistant header (default True).
            continue_final_message: continue the last (assistant) message instead
                (needs ``add_generation_prompt=False``).

        Raises:
            RequestRejected: a conversation is malformed or its template fails to
                render (nothing was queued).
        """
        convs: list[Any]
        if messages and isinstance(messages[0], Mapping):
            convs = [messages]
        else:
            convs = list(messages)
        rendered = [
            render_chat_prompt(
                self.llm_engine.tokenizer,
                c,
                chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
            )
            for c in convs
        ]
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in rendered]
        outs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        for out, r in zip(outs, rendered):
            out.prompt = r.text
        return outs

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt, batched continuously.

        Args:
            prompts: one prompt or a list; a prompt is text, a list of token ids, or
                ``{"prompt_token_ids": [...], "cache_salt": "..."}``.
            sampling_params: one SamplingParams for all, or one per prompt
                (default :meth:`get_default_sampling_params`: the model's
                generation_config.json defaults, else vLLM's, temperature 1.0 and
                max_tokens 16).
            use_tqdm: show a ``tqdm`` progress bar (on stderr) over finished prompts
                when tqdm is installed (vLLM's default True); or a tqdm-like class to use.
            priority: one priority per prompt (vLLM's ``generate(priority=...)``: lower
                is served first; needs ``LLM(scheduling_policy="priority")`` for values
                other than 0). None = 0 for all.

        Returns:
            One finished RequestOutput per prompt, in order. A prompt the engine rejects
            (empty, too long, never fits the pool, invalid parameters) gets an output
            with ``error`` set to its RequestRejected and no completions; the others
            run normally.

        Raises:
            RequestRejected: ``sampling_params`` or ``priority`` is a list of the wrong
                length.
            RuntimeError: another thread's ``generate`` on this LLM is running
                (nothing was added).
            Exception: a step failed (model, sampler); every request of this call is
                aborted first, so the LLM stays usable.
        """
        if (
            isinstance(prompts, (str, bytes, bytearray, Mapping, numbers.Number))
            or not isinstance(prompts, Iterable)
            or (isinstance(prompts, (np.ndarray, torch.Tensor)) and prompts.ndim <= 1)
            or (
                isinstance(prompts, (list, tuple))
                and prompts
                and not isinstance(prompts[0], (str, Mapping, list, tuple, np.ndarray))
                and not isinstance(prompts[0], torch.Tensor)
            )
        ):
            # one prompt: text, token ids (a list of ids, a 1-D numpy array or tensor),
            # a dict, or something invalid that add_request rejects as one prompt
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            plist = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            plist = list(sampling_params)
            if len(plist) != len(prompts):
                raise RequestRejected(
                    f"sampling_params: expected {len(prompts)} entries (one per prompt), "
                    f"got {len(plist)}",
                    reason="invalid_sampling_params",
                )
        prios = [0] * len(prompts) if priority is None else list(priority)
        if len(prios) != len(prompts):
            raise RequestRejected(
                f"priority: expected {len(prompts)} entries (one per prompt), got {len(prios)}",
                reason="invalid_request",
            )
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                "LLM.generate: another thread's generate on this LLM is running; use one "
                "LLM per thread (or kvpage serve for concurrent requests)"
            )
        try:
            return self._generate(prompts, plist, prios, use_tqdm)
        finally:
            self._busy.release()

    def _generate(
        self,
        prompts: list[Any],
        plist: list[SamplingParams],
        prios: list[int],
        use_tqdm: bool | Callable[..., Any],
    ) -> list[RequestOutput]:
        """``generate`` after its arguments were checked and the LLM was taken."""
        eng = self.llm_engine
        ids: list[str] = []
        results: dict[str, RequestOutput] = {}
        for prompt, params, prio in zip(prompts, plist, prios):
            rid = str(self._counter)
            self._counter += 1
            ids.append(rid)
            try:
                eng.add_request(rid, prompt, params, priority=prio)
            except RequestRejected as e:
                now = time.monotonic()
                results[rid] = RequestOutput(
                    request_id=rid,
                    prompt=prompt if isinstance(prompt, str) else None,
                    prompt_token_ids=[],
                    num_cached_tokens=0,
                    outputs=[],
                    finished=True,
                    arrival_time=now,
                    finish_time=now,
                    error=e,
                )
        pending = {r for r in ids if r not in results}
        bar = _progress_bar(use_tqdm, len(pending))
        try:
            while pending:
                for out in eng.step(finished_only=True):
                    if out.finished and out.request_id in pending:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
                if pending and not eng.has_unfinished_requests():  # pragma: no cover
                    raise RuntimeError(f"engine stopped with unfinished requests {sorted(pending)}")
        except BaseException:
            # a failed step (or Ctrl-C): abort this call's other requests too, so the
            # engine holds no blocks for them and the next generate starts clean
            for r in sorted(pending):
                eng.abort_request(r)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[r] for r in ids]


def _progress_bar(use_tqdm: bool | Callable[..., Any], total: int) -> Any:
    """A tqdm bar over ``total`` prompts, or None (off, nothing to do, or no tqdm)."""
    if not use_tqdm or total == 0:
        return None
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="Processed prompts", unit="prompt")
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the ``cli`` extra is not installed: no bar
        return None
    return tqdm(total=total, desc="Processed prompts", unit="prompt", dynamic_ncols=True)


__all__ = ["LLM"]
