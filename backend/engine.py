"""Engine: SGLang's offline Engine shape. Validates and tokenizes requests on the caller's
thread, hands them to the scheduler loop running on its own thread, and delivers results
blocking, streamed, or to asyncio. Bad input raises ValueError before any model work."""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any, TypeVar, cast

import torch

from radixlm.kernels import compiled_kernel_count

from . import collector, limits
from .constrained import warm_grammars
from .embeddings import (
    check_inputs,
    embed,
    embed_when_room,
    embedding_inputs,
    sglang_embeddings,
    single_input,
)
from .engine_inbox import EngineInbox, RunCall, Stop
from .engine_inputs import check_engine_options
from .engine_release import release_device
from .engine_requests import EngineRequests
from .engine_server_args import recorded_args, resolve_server_args, server_info
from .loader import default_model_path, load_config, resolve_model_dir
from .model_config import ModelConfig, named_shape_config
from .model_runner import ModelRunner, resolve_dtype
from .prefix_cache import BasePrefixCache, NoPrefixCache
from .radix_cache import RadixCache
from .sampler import Sampler
from .scheduler import Scheduler
from .scheduler_config import SchedulerConfig, SpeculativeConfig
from .speculative_draft import DraftModelProposer, load_draft_runner
from .stall_guard import StallGuard
from .tokenizer import load_tokenizer
from .tp_workers import TPDriver, engine_shards, start_workers
from .warmup import measure_cascade_costs, warm_request_path, warm_up

logger = logging.getLogger(__name__)

T = TypeVar("T")
_live_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


def _shutdown_live_engines() -> None:
    """Runs at interpreter exit, before module teardown: a scheduler thread still freeing torch
    tensors while the interpreter finalizes aborts the process (std::terminate, exit 134)."""
    for engine in list(_live_engines):
        try:
            engine.shutdown()
        except Exception:  # one engine's failure must not keep the others running
            logger.exception("engine shutdown at exit failed")


atexit.register(_shutdown_live_engines)


class Engine(EngineRequests):
    def __init__(
        self,
        model_path: str | None = None,
        tokenizer_path: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        max_total_tokens: int | None = None,
        mem_fraction_static: float = 0.85,
        chunked_prefill_size: int | None = None,
        max_running_requests: int | None = None,
        disable_radix_cache: bool = False,
        random_weights: bool = False,
        model_shape: str | None = None,
        context_length: int | None = None,
        seed: int = 0,
        log_level: str = "warning",
        disable_jump_forward: bool | None = None,
        disable_cuda_graph: bool = False,
        cuda_graph_max_bs: int | None = None,
        piecewise_cuda_graph_max_tokens: int | None = None,
        overlap_schedule: bool | None = None,
        disable_cascade: bool = False,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        speculative_algorithm: str | None = None,
        speculative_num_draft_tokens: int | None = None,
        speculative_policy: str = "auto",
        speculative_draft_model_path: str | None = None,
        tp_size: int = 1,
        **sglang_server_args: Any,
    ) -> None:
        """overlap_schedule: process step t while step t+1 runs (None: on for CUDA, where it hides
        the host's per-step work; on CPU the forward runs on the host, so there is nothing to hide).
        piecewise_cuda_graph_max_tokens: extend steps (prompts, mixed steps) of up to this many
        tokens replay their layers' dense work from CUDA graphs, attention eager between them
        (None: 1,024 on CUDA; 0: every extend step eager).
        disable_cascade: never use cascade attention for decode batches sharing a long prefix.
        quantization: for GGUF files, "gguf" keeps the weights as GGUF blocks, "dequantize" turns
        them into `dtype` at load, None/"auto" keeps them on the CPU and dequantizes on CUDA; for
        float weights, "q4_0"/"q4_1"/"q8_0" quantize the layers' linears and the LM head into
        GGUF blocks after load and "fp8" the layers' linears into e4m3 with per-row scales.
        kv_cache_dtype: "auto" keeps the KV cache in the model dtype; "fp8_e4m3" stores it as fp8
        (per-head scales, 1 unless set on runner.kv_pool), so the same memory holds ~2x the tokens.
        speculative_algorithm: "ngram" (prompt lookup) or "draft" (the model at
        speculative_draft_model_path, same tokenizer) speculates for requests that do not say
        otherwise; speculative_policy "auto" backs off where it does not pay, "always" never does;
        speculative_num_draft_tokens: most drafts per request per step (None: 7 for "ngram", whose
        drafts are free to propose and which the policy trims to those that pay; 4 for "draft").
        tp_size: tensor parallelism over that many CPU processes (gloo): this process is rank 0 and
        holds the scheduler; the model's heads and MLP columns are split over the ranks.
        sglang_server_args: SGLang's ServerArgs names (random_seed, disable_overlap_schedule,
        trust_remote_code, ...), each honoured, accepted or refused (backend/engine_server_args.py)."""
        own = resolve_server_args(sglang_server_args, {"seed": seed, "overlap_schedule": overlap_schedule})
        seed, overlap_schedule = own["seed"], own["overlap_schedule"]
        self.server_args = recorded_args(locals())  # the options as passed, for get_server_info()
        logging.getLogger("radixlm").setLevel(log_level.upper())
        speculative = SpeculativeConfig(
            speculative_algorithm,
            speculative_num_draft_tokens,
            speculative_policy,
            speculative_draft_model_path,
        )
        check_engine_options(
            device,
            {"piecewise_cuda_graph_max_tokens": piecewise_cuda_graph_max_tokens},
            mem_fraction_static,
            cuda_graph_max_bs=cuda_graph_max_bs,
            max_total_tokens=max_total_tokens,
            chunked_prefill_size=chunked_prefill_size,
            max_running_requests=max_running_requests,
            context_length=context_length,
        )
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        config, model_dir = self._resolve_model(model_path, model_shape)
        if context_length is not None:
            config.max_position_embeddings = context_length
        self.model_config: ModelConfig = config
        self.model_path = str(model_path or (model_shape and f"random:{model_shape}") or default_model_path())
        self.tokenizer_source = tokenizer_path or model_dir  # None: the default model's tokenizer
        self.tokenizer = load_tokenizer(self.tokenizer_source)
        eos = set(config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None and model_shape is None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        shards = engine_shards(tp_size, config, self.device, random_weights or bool(model_shape))
        self.runner = ModelRunner(
            config,
            None if model_shape else model_dir,
            self.device,
            resolve_dtype(dtype, self.device),
            max_total_tokens,
            mem_fraction_static,
            max_running_requests,
            random_weights or bool(model_shape),
            seed,
            disable_cuda_graph=disable_cuda_graph,
            cuda_graph_max_bs=cuda_graph_max_bs,
            cascade_graphs=not disable_cascade,
            quantization=quantization,
            tp=shards[0] if shards else None,
            kv_cache_dtype=kv_cache_dtype,
            piecewise_max_tokens=piecewise_cuda_graph_max_tokens,
        )
        self._tp: TPDriver | None = None
        if shards and model_dir is not None:
            self._tp = start_workers(self.runner, model_dir, quantization, shards)
        self.cache: BasePrefixCache = NoPrefixCache() if disable_radix_cache else RadixCache()
        chunk = (
            chunked_prefill_size
            if chunked_prefill_size is not None
            else limits.chunked_prefill_size(self.device)
        )
        chunk = chunk if chunk > 0 else config.context_len
        max_running_requests = self.runner.max_running_requests
        overlap = self.device.type == "cuda" if overlap_schedule is None else overlap_schedule
        cascade = not disable_cascade and self.runner.supports_cascade
        self.scheduler = Scheduler(
            self.runner,
            self.cache,
            Sampler(config.vocab_size, self.device, seed),
            SchedulerConfig(
                config.context_len,
                chunk,
                max_running_requests,
                overlap=overlap,
                enable_cascade=cascade,
                speculative=speculative,
            ),
        )
        if speculative_draft_model_path:
            draft = load_draft_runner(speculative_draft_model_path, self.runner)
            self.scheduler.spec.proposers["draft"] = DraftModelProposer(draft)
        self.warmup_stats = warm_up(self.runner, cascade)
        if cascade:
            self.scheduler.cfg.cascade_cost = measure_cascade_costs(self.runner)
        self._compiles_at_start = compiled_kernel_count()
        self._inbox = EngineInbox()
        self._pin_ids = itertools.count(1)
        self._tok_lock = threading.Lock()
        self._live_rids: set[str] = set()  # ids of submitted requests not yet finished
        self._rid_lock = threading.Lock()  # not the tokenizer's: the scheduler thread takes it
        self._closed = False
        if disable_jump_forward is None:
            # A request that may gain forced tokens is processed before the next step is planned,
            # so with graphs and overlap its steps lose the overlap, which costs more than the
            # passes jump-forward saves (the suite's JSON workload measures both); it is on where
            # every step is eager.
            disable_jump_forward = self.runner.graph_runner is not None
        self.disable_jump_forward = disable_jump_forward  # grammar jump-forward (backend/constrained.py)
        # created on the first constrained request, or by the warm-up thread (which must find this
        # attribute already set: assigning it after the thread starts would discard what it built)
        self._grammar_backend = None
        self._grammar_warmup: threading.Thread | None = None
        if self.device.type == "cuda":  # index the vocabulary for grammars now, not on the first request
            self._grammar_warmup = threading.Thread(
                target=warm_grammars, args=(self,), name="radixlm-grammar-warmup", daemon=True
            )
            self._grammar_warmup.start()
        self._final_stats: dict[str, int] | None = None
        self._thread = threading.Thread(target=self._loop, name="radixlm-scheduler", daemon=True)
        self._thread.start()
        _live_engines.add(self)
        if self.device.type == "cuda":  # the first user batch then compiles nothing
            if self._grammar_warmup is not None:
                self._grammar_warmup.join()  # its grammar backend serves the warm JSON request
            try:
                warm_request_path(self.generate, config.vocab_size, config.context_len)
            except Exception:  # a first real request compiles instead, and reports its own error
                logger.exception("request-path warm-up failed")
            self.flush_cache()
            self._call(self.scheduler.stats.reset)
            self._compiles_at_start = compiled_kernel_count()
        # start-up built objects that live as long as the engine: a full collection would walk
        # them all, on the scheduler thread mid-step
        collector.engine_started()

    @staticmethod
    def _resolve_model(model_path: str | None, model_shape: str | None) -> tuple[ModelConfig, Any]:
        if model_shape:
            return named_shape_config(model_shape), None
        model_dir = resolve_model_dir(model_path)
        return load_config(model_dir), model_dir

    # ---- the scheduler thread -----------------------------------------------------------
    def _loop(self) -> None:
        sched = self.scheduler
        guard = StallGuard(sched)
        while True:
            # a stalled scheduler changes only through a message: wait for one instead of spinning
            if not self._inbox.drain(sched, block=not sched.has_work() or guard.stalled):
                break
            if sched.has_work():
                guard.step()
            else:
                guard.idle()
        self._abort_all("engine shut down")
        self._inbox.refuse_all()

    def _abort_all(self, message: str) -> None:
        self.scheduler.fail_all(message)

    def _call(self, fn: Callable[[], T]) -> T:
        """Run fn on the scheduler thread (between steps) and wait for its result."""
        if self._closed:
            raise RuntimeError("engine is shut down")
        fut: Future[object] = Future()
        self._inbox.put(RunCall(fn, fut))
        return cast(T, fut.result())  # the inbox sets fn's own result

    # ---- public API (generate, async_generate, abort_request, pin_prefix: engine_requests.py) ----
    def flush_cache(self) -> bool:
        """Empty the prefix cache. Refused (False) while requests run or prefixes are pinned."""

        def flush() -> bool:
            s = self.scheduler
            s.settle()
            if s.has_work() or s.pinned:
                return False
            s.kv.flush()
            return True

        return self._call(flush)

    def get_server_info(self) -> dict[str, Any]:
        """SGLang's Engine.get_server_info(): the engine's options and state (engine_server_args.py)."""
        return server_info(self)

    def encode(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        pooling: str = "last",
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """SGLang's shape: {"embedding": [...], "meta_info": {...}} for one input (a string, or one
        list of ids), a list of those for several. Each embedding is the final normalized hidden
        state of the input's last token (or the mean over its tokens), L2-normalized."""
        start = time.perf_counter()
        id_lists, vectors = self._embed(prompt, input_ids, pooling)
        return sglang_embeddings(id_lists, vectors, single_input(prompt, input_ids), start)

    def encode_vectors(
        self, prompt: Any = None, input_ids: Any = None, pooling: str = "last"
    ) -> list[list[float]]:
        """encode()'s vectors alone, one per input (what /v1/embeddings sends)."""
        return self._embed(prompt, input_ids, pooling)[1]

    def _embed(self, prompt: Any, input_ids: Any, pooling: str) -> tuple[list[list[int]], list[list[float]]]:
        if self._closed:
            raise RuntimeError("engine is shut down")
        with self._tok_lock:
            id_lists = embedding_inputs(self.tokenizer, prompt, input_ids)
        cfg = self.model_config
        check_inputs(id_lists, pooling, cfg.context_len, cfg.vocab_size, self.runner.allocator.size)
        holds = self.scheduler.queues.embedding_holds
        return id_lists, [
            embed_when_room(
                self._call, partial(embed, self.runner, self.scheduler.kv, ids, pooling), holds, len(ids)
            )
            for ids in id_lists
        ]

    def unpin_prefix(self, handle: int) -> None:
        self._call(lambda: self.scheduler.unpin(handle))

    def get_stats(self) -> dict[str, int]:
        """Counters of the engine's work; after shutdown, the last counters it had."""
        if self._final_stats is not None:
            return dict(self._final_stats)
        s = self.scheduler
        st = s.stats
        alloc = self.runner.allocator
        return {
            "num_running": len(s.running) + (1 if s.chunked else 0),
            "num_waiting": len(s.waiting),
            "kv_total_slots": alloc.size,
            "kv_free_slots": alloc.available_size(),
            "kv_cached_slots": self.cache.total_size(),
            "cached_prompt_tokens": st.cached_prompt_tokens,
            "computed_prompt_tokens": st.computed_prompt_tokens,
            "generated_tokens": st.generated_tokens,
            "num_retractions": st.num_retractions,
            "forward_passes": st.forward_passes,
            "num_finished": st.num_finished,
            "num_aborted": st.num_aborted,
            "kernel_compiles_since_start": compiled_kernel_count() - self._compiles_at_start,
            **st.extra,
        }

    @property
    def is_shut_down(self) -> bool:
        return self._closed

    def shutdown(self) -> None:
        """Abort what runs, stop and join the scheduler thread, then free the device memory the
        engine owns (weights, KV pool, CUDA graphs) even if others still reference the engine."""
        if self._closed:
            return
        self._closed = True
        _live_engines.discard(self)
        self._inbox.put(Stop())
        self._thread.join(timeout=30)
        self._inbox.refuse_all()  # anything queued after the loop's own final drain
        if self._thread.is_alive():  # a step is stuck: its tensors stay where the thread uses them
            logger.error("scheduler thread did not stop within 30 s; device memory not released")
            return
        if self._tp is not None:
            self._tp.stop()
        self._release_device()

    def _release_device(self) -> None:
        self._final_stats = self.get_stats()
        model, pool = weakref.ref(self.runner.model), weakref.ref(self.runner.kv_pool)
        self.scheduler = self.cache = self.runner = self._grammar_backend = None  # type: ignore[assignment]
        release_device(model, pool, self.device, others_running=bool(_live_engines))

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
