"""The ``kvmesh`` command line."""

from __future__ import annotations

import argparse
import logging
import sys

from kvmesh.worker import envs
from kvmesh.worker.defaults import DEFAULT_RESIDUAL_PAGES


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """The model and its formats: every command that builds an engine takes these."""
    from kvmesh.worker.defaults import DEFAULT_MODEL

    p.add_argument(
        "--model", default=DEFAULT_MODEL, help="registered name, .gguf file or HF folder"
    )
    p.add_argument(
        "--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), fp32, fp16, bf16"
    )
    p.add_argument(
        "--kv-cache-dtype", default="auto", help="auto, fp32, fp16, bf16, fp8, int8, int4"
    )


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    p.add_argument("--kv-cache-memory", default="1GiB", help="byte budget of the KV page pool")
    p.add_argument(
        "--kv-residual-pages",
        type=int,
        default=DEFAULT_RESIDUAL_PAGES,
        help="quantized KV formats: each running request's last N pages kept in full "
        "precision beside the pool and read exact (docs/formats.md)",
    )
    p.add_argument(
        "--host-cache-memory", default=None, help="host-RAM tier for spilled pages, e.g. 4GiB"
    )
    p.add_argument("--redis-url", default=None, help="Redis tier, e.g. redis://host:6379/0")
    p.add_argument(
        "--redis-ttl",
        type=float,
        default=24 * 3600.0,
        help="seconds a page stays in Redis after it was written (default 86400; 0: no expiry, "
        "Redis's own eviction policy decides)",
    )
    p.add_argument(
        "--redis-namespace",
        default="kvmesh",
        help="prefix of kvmesh's Redis keys, e.g. one per cluster sharing a Redis",
    )
    p.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="another worker's KVTransfer address to fetch pages from (repeatable)",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--preemption-reserve",
        type=float,
        default=0.5,
        metavar="SHARE",
        help="after a preemption, admit a waiting request only if this share of every "
        "admitted request's remaining max_tokens still fits (doubled at each further "
        "preemption; 0: always admit what the prompt fits)",
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--kv-budget",
        type=int,
        default=None,
        metavar="TOKENS",
        help="default KV budget of every request that sets none: at most this many tokens of "
        "its cache are kept (docs/eviction.md; default: no eviction; a request opts out with "
        "kv_policy='none')",
    )
    p.add_argument(
        "--kv-policy",
        default=None,  # resolved to snapkv after the check: an explicit one needs --kv-budget
        help="eviction policy of that default budget: snapkv (default), h2o, streaming, "
        "scissorhands, random; needs --kv-budget",
    )


def _eviction_kwargs(a: argparse.Namespace) -> dict:
    """--kv-budget / --kv-policy, checked here with the flags' names (before any engine or
    cluster starts). An explicit --kv-policy, the default's name included, needs a budget."""
    from kvmesh.worker.sampling_params import validate_kv_budget

    if a.kv_budget is None and a.kv_policy is not None:
        raise ValueError(f"--kv-policy {a.kv_policy} needs a --kv-budget (the default budget)")
    policy = a.kv_policy or "snapkv"
    try:
        validate_kv_budget(a.kv_budget, policy, opt_out=False)
    except ValueError as e:
        msg = str(e).replace("kv_budget", "--kv-budget").replace("kv_policy", "--kv-policy")
        raise ValueError(msg) from None
    return dict(kv_budget=a.kv_budget, kv_policy=policy)


def _engine_kwargs(
    a: argparse.Namespace, security: dict | None = None, *, peer_tiers: bool = True
) -> dict:
    """The engine's keyword arguments; ``--peer`` tiers are built (as a cluster member:
    ``security``'s identity, else ``KVMESH_CLUSTER_SECRET``) unless ``peer_tiers`` is off."""
    return dict(
        dtype=a.dtype,
        kv_cache_dtype=a.kv_cache_dtype,
        kv_cache_memory=a.kv_cache_memory,
        kv_residual_pages=a.kv_residual_pages,
        block_size=a.block_size,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        preemption_reserve=a.preemption_reserve,
        max_model_len=a.max_model_len,
        enable_prefix_caching=not a.no_prefix_caching,
        host_cache_memory=a.host_cache_memory,
        redis_url=a.redis_url,
        redis_ttl_s=a.redis_ttl or None,
        redis_namespace=a.redis_namespace,
        extra_tiers=_peer_tiers(a.peer, security) if peer_tiers else [],
        **_eviction_kwargs(a),
    )


def _peer_tiers(addresses: list[str], security: dict | None = None) -> list:
    if not addresses:
        return []
    from kvmesh.kvstore.peer import PeerTier

    if security is None and envs.cluster_secret():
        from kvmesh.protos.security import ClusterIdentity

        security = {"identity": ClusterIdentity.from_text(envs.cluster_secret())}
    security = security or {}
    if security.get("identity") is None:
        raise ValueError(
            "--peer needs the cluster secret (--cluster-secret-file or KVMESH_CLUSTER_SECRET): "
            "peers serve pages to cluster members only"
        )
    tls = security.get("tls")
    creds = tls.channel_credentials() if tls is not None else None
    return [PeerTier(addresses, identity=security["identity"], credentials=creds)]


def _add_security_args(p: argparse.ArgumentParser, *, serve: bool = False) -> None:
    """Identity, TLS, client tokens and the default deadline (docs/security.md)."""
    p.add_argument(
        "--cluster-secret-file",
        default=None,
        metavar="PATH",
        help="the cluster secret (>= 16 bytes, e.g. `openssl rand -hex 32`) members prove "
        + (
            "to each other (default: a random one per cluster)"
            if serve
            else "to each other (default: $KVMESH_CLUSTER_SECRET; without either, KVTransfer, "
            "GetLoad and peer hints are refused to everyone)"
        ),
    )
    p.add_argument(
        "--token-file",
        default=None,
        metavar="PATH",
        help="client bearer tokens, one per line: Generate, Abort and GetModelInfo, and every "
        "HTTP API path but GET /health, then need 'authorization: Bearer <token>' "
        "(default: open)",
    )
    p.add_argument("--tls-cert", default=None, metavar="PEM", help="serve TLS: certificate chain")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="serve TLS: private key")
    p.add_argument(
        "--tls-client-ca",
        default=None,
        metavar="PEM",
        help="require client certificates signed by this CA (mutual TLS)",
    )
    p.add_argument(
        "--tls-ca",
        default=None,
        metavar="PEM",
        help="CA that other members' certificates chain to, for this process's connections "
        "to them (default: the system's roots)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="server-side deadline of one Generate (default 3600; a client's shorter one wins)",
    )


def _security_kwargs(a: argparse.Namespace, *, serve: bool = False) -> dict:
    """``identity``, ``tls``, ``tokens``, ``default_deadline_s`` from the flags (and, for a
    worker, ``KVMESH_CLUSTER_SECRET``). ``kvmesh serve`` without a secret file leaves
    ``identity`` None: the cluster draws its own."""
    from kvmesh.protos.security import BearerTokens, ClusterIdentity, TLSConfig
    from kvmesh.protos.serving import DEFAULT_DEADLINE_S

    if a.cluster_secret_file:
        identity = ClusterIdentity.from_file(a.cluster_secret_file)
    elif not serve and envs.cluster_secret():
        identity = ClusterIdentity.from_text(envs.cluster_secret())
    else:
        identity = None
    if a.request_timeout is not None and not a.request_timeout > 0:
        raise ValueError(f"--request-timeout must be > 0 seconds, got {a.request_timeout}")
    return dict(
        identity=identity,
        tls=TLSConfig.from_files(a.tls_cert, a.tls_key, a.tls_client_ca, a.tls_ca),
        tokens=BearerTokens.from_file(a.token_file) if a.token_file else None,
        default_deadline_s=a.request_timeout or DEFAULT_DEADLINE_S,
    )


def cmd_eval_ppl(a: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from kvmesh.worker import LLMEngine
    from kvmesh.worker.eval import evaluate_perplexity

    text_path = Path(a.text)
    if not text_path.is_file():
        raise FileNotFoundError(f"--text {a.text}: no such file")
    if a.kv_budget is not None:  # its windows run outside the scheduler: nothing would compact
        raise ValueError(
            "--kv-budget does not apply to eval-ppl (it scores windows outside the scheduler, "
            "where no compaction runs); bench/eviction.py --parts ppl measures budgets"
        )
    kw = _engine_kwargs(a)
    kw["max_num_batched_tokens"] = a.chunk  # prefill chunks go through the cache
    kw["enable_prefix_caching"] = False  # every window is computed, never served from cache
    kw["max_model_len"] = max(a.context + 1, kw["max_model_len"] or 0)
    engine = LLMEngine(a.model, **kw)
    res = evaluate_perplexity(engine, text_path.read_text(), a.context, a.windows)
    if a.json:
        print(json.dumps(res.as_dict()))
    else:
        print(
            f"{res.kv_cache_dtype}: ppl {res.ppl:.4f} over {res.tokens} tokens "
            f"({res.windows} x {res.context}), {res.bits_per_value:.3g} bits/value, "
            f"{res.bytes_per_token:.0f} bytes/token"
        )
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    from kvmesh.worker import LLMEngine, SamplingParams

    engine = LLMEngine(a.model, **_engine_kwargs(a))
    prompt = a.prompt
    if a.chat:
        if engine.tokenizer is None:
            print("error: this model has no tokenizer, so no chat template", file=sys.stderr)
            return 2
        messages = [{"role": "user", "content": prompt}]
        if a.system:
            messages.insert(0, {"role": "system", "content": a.system})
        prompt = engine.tokenizer.apply_chat_template(messages)
    params = SamplingParams(
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        seed=a.seed,
    )
    rid = engine.add_request(prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
                final = out
    sys.stdout.write("\n")
    sys.stdout.flush()
    if final is not None:
        print(
            f"[{len(final.token_ids)} tokens, finish_reason={final.finish_reason}, "
            f"ttft={final.ttft_s:.3f}s]",
            file=sys.stderr,
        )
    return 0


def cmd_worker(a: argparse.Namespace) -> int:
    from kvmesh.worker.server import serve_worker

    if a.flush_timeout < 0:
        raise ValueError(f"--flush-timeout must be >= 0 seconds, got {a.flush_timeout}")
    security = _security_kwargs(a)
    engine_kwargs = _engine_kwargs(a, security)
    serve_worker(
        a.model,
        port=a.port,
        host=a.host,
        max_message_mb=a.max_message_mb,
        grace_s=a.grace_period,
        max_waiting=a.max_waiting,
        flush_timeout_s=a.flush_timeout,
        data_plane=False if a.no_data_plane else None,
        data_plane_port=a.data_plane_port,
        http_port=a.http_port,
        metrics_port=a.metrics_port,
        **security,
        **engine_kwargs,
    )
    return 0


def cmd_simulate_router(a: argparse.Namespace) -> int:
    import json

    from kvmesh.router.profiles import get_profile
    from kvmesh.router.simulator import (
        SimConfig,
        format_table,
        load_trace,
        resolve_policies,
        simulate_policies,
    )

    policies = resolve_policies(a.policy)
    cfg = SimConfig(
        workers=a.workers,
        capacity_tokens=a.capacity_tokens,
        host_capacity_tokens=a.host_capacity_tokens,
        redis=a.redis,
        profile=get_profile(a.profile),
        speed=a.speed,
        seed=a.seed,
    )
    trace = load_trace(a.trace, limit=a.limit)
    results = simulate_policies(trace, policies, cfg)
    if a.json:
        print(json.dumps({name: r.to_dict() for name, r in results.items()}, indent=2))
    else:
        print(
            f"{len(trace)} requests, {cfg.workers} workers x {cfg.capacity_tokens} tokens, "
            f"profile {cfg.profile.name}, speed {cfg.speed}x"
        )
        print(format_table(results))
    return 0


def cmd_calibrate_profile(a: argparse.Namespace) -> int:
    import json
    from dataclasses import replace

    from kvmesh.cluster.calibrate import QUICK, CalibrationError, CalibrationSizes, calibrate

    sizes = QUICK if a.quick else CalibrationSizes()
    given = {k: getattr(a, k) for k in _CALIBRATION_SIZES if getattr(a, k) is not None}
    sizes = replace(sizes, **given)
    try:
        result = calibrate(
            a.model,
            name=a.name,
            dtype=a.dtype,
            kv_cache_dtype=a.kv_cache_dtype,
            redis_url=a.redis_url,
            sizes=sizes,
            text_path=a.text,
            threads=a.threads,
        )
    except CalibrationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    text = json.dumps(result, indent=2) + "\n"
    if a.output:
        with open(a.output, "w") as f:
            f.write(text)
        print(f"calibrate: wrote profile {result['name']!r} to {a.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


# calibrate-profile's size options: CalibrationSizes field -> help
_CALIBRATION_SIZES = {
    "prefill_tokens": "prompt tokens of each timed cold prefill (default 2048)",
    "prefix_tokens": "cached prefix served from host / Redis (default 2048)",
    "repeats": "prompts per prefill and tier measurement, median taken (default 5)",
    "tier_promotions": "host / Redis promotions per prompt after its cold prefill, each a sample "
    "(default 1)",
    "decode_batch": "requests decoding together (default 32)",
    "decode_prompt_tokens": "prompt tokens of each decoding request (default 32)",
    "decode_tokens": "output tokens of each decoding request (default 32)",
    "max_num_batched_tokens": "the engine's token budget per step (default 2048)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh", description="kvmesh LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt and stream it to stdout")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--system", default=None, help="system message (with --chat)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    _add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    w = sub.add_parser(
        "worker", help="serve one engine over gRPC (Inference, KVTransfer, health, reflection)"
    )
    w.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    w.add_argument("--host", default="0.0.0.0", help="address to bind")
    w.add_argument("--max-message-mb", type=int, default=64, help="gRPC message size limit")
    w.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="serve the OpenAI-compatible HTTP API on this port too (0: any free port)",
    )
    w.add_argument(
        "--grace-period",
        type=float,
        default=10.0,
        help="seconds in-flight streams may finish after SIGTERM/SIGINT",
    )
    w.add_argument(
        "--flush-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on shutdown, write the cached pages down to --redis-url for at most this long "
        "(0: no flush)",
    )
    w.add_argument("--max-waiting", type=int, default=4096, help="queue size (RESOURCE_EXHAUSTED)")
    w.add_argument(
        "--data-plane-port",
        type=int,
        default=0,
        help="TCP port of the page data plane peers fetch from (0: any free port)",
    )
    w.add_argument(
        "--no-data-plane",
        action="store_true",
        help="serve peers over gRPC KVTransfer.Fetch only (no raw-TCP page port)",
    )
    _add_security_args(w)
    w.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus /metrics on this port (0: any free port; default: not served)",
    )
    _add_engine_args(w)
    w.set_defaults(func=cmd_worker)

    e = sub.add_parser(
        "eval-ppl", help="perplexity of a text through the paged engine (KV format quality)"
    )
    e.add_argument("--text", required=True, help="a UTF-8 text file")
    e.add_argument("--context", type=int, default=1024, help="tokens per window")
    e.add_argument("--windows", type=int, default=8, help="consecutive windows to score")
    e.add_argument("--chunk", type=int, default=256, help="prefill chunk (tokens per step)")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    _add_engine_args(e)
    e.set_defaults(func=cmd_eval_ppl)

    s = sub.add_parser(
        "simulate-router", help="replay a Mooncake-format trace through the router's policies"
    )
    s.add_argument("--trace", required=True, help="JSONL trace (Mooncake format)")
    s.add_argument("--workers", type=int, required=True)
    s.add_argument("--capacity-tokens", type=int, required=True, help="device cache per worker")
    s.add_argument("--policy", default="all", help="a policy name, or all (default)")
    s.add_argument("--host-capacity-tokens", type=int, default=0, help="host tier per worker")
    s.add_argument("--redis", action="store_true", help="a shared, unbounded Redis tier")
    s.add_argument(
        "--profile",
        default="llama3-8b-h100",
        help="cost profile: a built-in name, or a .json file from calibrate-profile",
    )
    s.add_argument("--speed", type=float, default=1.0, help="replay speed-up of the timestamps")
    s.add_argument("--limit", type=int, default=None, help="only the first N requests")
    s.add_argument("--seed", type=int, default=0, help="seed of the policies' tie-breaks")
    s.add_argument("--json", action="store_true", help="print one JSON object keyed by policy")
    s.set_defaults(func=cmd_simulate_router)

    c = sub.add_parser(
        "calibrate-profile",
        help="measure a simulate-router cost profile with this machine's engine (JSON)",
    )
    _add_model_args(c)
    c.add_argument("--name", default=None, help="profile name (default: model-device-format)")
    c.add_argument(
        "--redis-url",
        default=None,
        help="Redis to time (default: a throwaway redis-server on a free loopback port)",
    )
    c.add_argument("--output", default=None, help="write the JSON here (default: stdout)")
    c.add_argument("--text", default=None, help="text the prompts are cut from")
    c.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads for the run (default: KVMESH_NUM_THREADS or torch's)",
    )
    c.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, noisy numbers")
    for field, help_ in _CALIBRATION_SIZES.items():
        c.add_argument("--" + field.replace("_", "-"), type=int, default=None, help=help_)
    c.set_defaults(func=cmd_calibrate_profile)

    from kvmesh.cluster.serve import add_serve_parser  # Ray loads only when `serve` runs
    from kvmesh.cluster.top import add_top_parser

    add_serve_parser(sub)
    add_top_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=envs.log_level(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
