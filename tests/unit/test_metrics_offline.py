"""Metrics without a model or a cluster: the router's metrics over a pure RouterCore, the
/metrics server's format, ``kvmesh top``'s arithmetic, and the deploy/ files against the
metric list in docs/metrics.md (the real-Prometheus checks are in
tests/integration/test_metrics.py)."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, generate_latest

from kvmesh.cluster.top import WorkerRow, histogram_quantile, render
from kvmesh.kvstore.hashing import hash_pages
from kvmesh.protos.metrics import serve_metrics
from kvmesh.router.core import RouterCore
from kvmesh.router.metrics import RouterMetrics, removal_cause
from kvmesh.worker.metrics import ITL_BUCKETS, TTFT_BUCKETS, buckets_1_2_5

ROOT = Path(__file__).resolve().parents[2]
FP, BS = "unit-model", 16


def samples(registry) -> dict[tuple, float]:
    """(sample name, sorted label items) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(registry, name: str, **labels) -> float:
    return sum(
        v for (n, ls), v in samples(registry).items()
        if n == name and all((k, w) in ls for k, w in labels.items())
    )  # fmt: skip


def test_token_buckets_are_vllms_1_2_5_series():
    assert buckets_1_2_5(100) == [1, 2, 5, 10, 20, 50, 100]
    assert buckets_1_2_5(2047)[-3:] == [500, 1000, 2000]
    assert TTFT_BUCKETS[0] == 0.001 and TTFT_BUCKETS[-1] == 2560.0 and len(TTFT_BUCKETS) == 22
    assert ITL_BUCKETS[0] == 0.01 and ITL_BUCKETS[-1] == 80.0


def _info(wid: str, cached: list[bytes], **kw) -> dict:
    return {
        "worker_id": wid, "name": wid, "address": f"{wid}:1", "model_fp": FP,
        "block_size": BS, "next_seq": len(cached), "pages": cached, "load": {}, **kw,
    }  # fmt: skip


def test_router_metrics_count_decisions_matches_and_removals():
    core = RouterCore(model_fp=FP, seed=0)
    m = RouterMetrics(core, model_name="m")
    core.metrics = m
    prompt = list(range(4 * BS + 3))
    hs = hash_pages(prompt, BS, FP)
    core.register(_info("a", hs[:3], metrics_address="10.0.0.1:9000"))
    core.register(_info("b", []))
    d = core.assign("r1", prompt, hs)
    assert d.worker_id == "a"  # it holds 3 of the prompt's 4 pages
    reg = m.registry
    assert value(reg, "kvmesh:router_decisions_total", reason=d.reason) == 1
    assert value(reg, "kvmesh:router_requests_total", worker="a") == 1
    assert value(reg, "kvmesh:router_prompt_tokens_total") == len(prompt)
    assert value(reg, "kvmesh:router_matched_tokens_total", tier="device") == 3 * BS
    assert value(reg, "kvmesh:router_decision_seconds_count") == 1
    assert value(reg, "kvmesh:router_workers") == 2
    assert value(reg, "kvmesh:router_index_pages", worker="a", tier="device") >= 3
    assert value(reg, "kvmesh:router_requests_in_flight", worker="a") == 1
    info = [ls for (n, ls), _ in samples(reg).items() if n == "kvmesh:router_worker_info"]
    assert ("metrics_address", "10.0.0.1:9000") in info[0] or (
        "metrics_address",
        "10.0.0.1:9000",
    ) in info[1]
    # every removal cause is exported from the start, then counted
    assert value(reg, "kvmesh:router_workers_removed_total", cause="report_timeout") == 0
    core.remove_worker("b", "no report for more than 4.0s")
    assert value(reg, "kvmesh:router_workers_removed_total", cause="report_timeout") == 1
    assert value(reg, "kvmesh:router_workers") == 1
    assert core.publish("b", [], None)["status"] == "unknown"
    assert value(reg, "kvmesh:router_resyncs_total", status="unknown") == 1


def _series(registry, worker: str) -> set[str]:
    """Names of the samples labelled with this worker."""
    return {n for (n, ls), _ in samples(registry).items() if ("worker", worker) in ls}


def test_a_retried_request_counts_its_prompt_once():
    core = RouterCore(model_fp=FP, seed=0)
    m = RouterMetrics(core, model_name="m")
    core.metrics = m
    prompt = list(range(4 * BS + 3))
    hs = hash_pages(prompt, BS, FP)
    core.register(_info("a", hs[:3]))
    core.register(_info("b", hs[:1]))
    assert core.assign("r1", prompt, hs).worker_id == "a"
    core.remove_worker("a", "Generate failed: UNAVAILABLE")  # what the router service does
    assert core.assign("r1", prompt, hs, exclude=["a"]).worker_id == "b"  # the retry
    reg = m.registry
    assert value(reg, "kvmesh:router_decisions_total") == 2  # every routing attempt
    assert value(reg, "kvmesh:router_requests_total", worker="b") == 1
    assert value(reg, "kvmesh:router_prompt_tokens_total") == len(prompt)  # one request
    assert value(reg, "kvmesh:router_matched_tokens_total") == 3 * BS  # its first routing


def test_a_dropped_workers_series_disappear():
    core = RouterCore(model_fp=FP, seed=0)
    m = RouterMetrics(core, model_name="m")
    core.metrics = m
    prompt = list(range(2 * BS))
    hs = hash_pages(prompt, BS, FP)
    core.register(_info("a", hs))
    core.register(_info("b", []))
    assert core.assign("r1", prompt, hs).worker_id == "a"
    core.release("r1")
    reg = m.registry
    assert "kvmesh:router_requests_total" in _series(reg, "a")
    assert "kvmesh:router_worker_info" in _series(reg, "a")
    core.remove_worker("a", "replaced by a-2")  # restarted under a new engine id
    assert _series(reg, "a") == set()
    assert "kvmesh:router_worker_info" in _series(reg, "b")
    assert value(reg, "kvmesh:router_workers_removed_total", cause="restarted") == 1


def test_removal_causes():
    assert removal_cause("replaced by w-2 (the worker restarted)") == "restarted"
    assert removal_cause("Generate failed: UNAVAILABLE x") == "unavailable"
    assert removal_cause("no answer to a health ping within 2.0s") == "health_check"
    assert removal_cause("something new") == "other"


def test_metrics_page_keeps_the_colon_whatever_the_scraper_accepts():
    reg = CollectorRegistry()
    Counter("kvmesh:prompt_tokens", "x", ["model_name"], registry=reg).labels("m").inc(3)
    srv = serve_metrics(reg, "127.0.0.1", 0)
    try:
        for accept in ("application/openmetrics-text; version=1.0.0", "text/plain", None):
            req = urllib.request.Request(f"http://{srv.address}/metrics")
            if accept:
                req.add_header("Accept", accept)
            with urllib.request.urlopen(req, timeout=5) as r:
                text = r.read().decode()
                assert r.headers["Content-Type"].startswith("text/plain")
            assert 'kvmesh:prompt_tokens_total{model_name="m"} 3.0' in text, (accept, text)
    finally:
        srv.stop()
    with pytest.raises(ValueError, match="metrics port"):
        serve_metrics(reg, "127.0.0.1", 70000)


def test_histogram_quantile_interpolates_like_prometheus():
    # 10 observations: 4 <= 0.1, 8 <= 0.2, 10 <= 0.4
    b = {0.1: 4, 0.2: 8, 0.4: 10, float("inf"): 10}
    assert histogram_quantile(0.5, b) == pytest.approx(0.125)
    assert histogram_quantile(0.9, b) == pytest.approx(0.3)
    assert histogram_quantile(0.5, {0.1: 0, float("inf"): 0}) is None
    assert histogram_quantile(0.99, {0.1: 0, float("inf"): 5}) == 0.1  # past the last bound


def test_top_renders_a_row_per_worker():
    from rich.console import Console

    rows = [
        WorkerRow("w-1", "kvmesh-worker-0", 2, 1, 0.5, {"device": 0.25, "host": 0.5}, 10.0, 0.02),
        WorkerRow("w-2", "kvmesh-worker-1", error="scrape failed: refused"),
    ]
    router = {"kvmesh:router_decisions_total": [({"policy": "p", "reason": "affinity"}, 3.0)]}
    con = Console(width=200, record=True)
    con.print(render("r:1", router, rows))
    text = con.export_text()
    assert "w-1" in text and "w-2" in text and "scrape failed" in text
    assert "50%" in text and "20 ms" in text and "affinity" in text
    assert "autoscaling" not in text  # a router without the autoscaler: no table


def test_top_shows_the_autoscalers_decisions_with_their_reasons():
    from rich.console import Console

    from kvmesh.router.metrics import PREFIX

    core = RouterCore(model_fp=FP)
    m = core.metrics = RouterMetrics(core, model_name="m")
    core.autoscale_config = {"min_workers": 1, "max_workers": 3}
    core.record_scaling(
        {"action": "down", "from_workers": 2, "to_workers": 1, "cause": "low_load",
         "reason": "every signal under its low mark", "worker": "kvmesh-worker-1",
         "flush": {"pages_written": 12}, "at": 1000.0}
    )  # fmt: skip
    assert value(m.registry, PREFIX + "autoscale_decisions_total", action="down") == 1
    assert value(m.registry, PREFIX + "autoscale_flushed_pages_total") == 12
    from prometheus_client.parser import text_string_to_metric_families

    router: dict = {}
    for fam in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for s in fam.samples:
            router.setdefault(s.name, []).append((s.labels, s.value))
    con = Console(width=240, record=True)
    con.print(render("r:1", router, []))
    text = con.export_text()
    assert "autoscaling 1..3 workers, 0 draining" in text
    assert "kvmesh-worker-1" in text and "every signal under its low mark" in text


# ---------------------------------------------------------------- deploy/ against the docs


def _documented() -> set[str]:
    text = (ROOT / "docs" / "metrics.md").read_text()
    return set(re.findall(r"`(kvmesh:[a-z_]+)", text))


def _used(expr: str) -> set[str]:
    names = set(re.findall(r"kvmesh:[a-z_]+", expr))
    # a histogram's series are its name plus _bucket / _count / _sum
    return {re.sub(r"_(bucket|count|sum)$", "", n) for n in names}


def test_dashboards_filter_by_model_and_use_only_documented_metrics():
    documented = _documented()
    dashboards = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
    assert len(dashboards) == 3
    uids = set()
    for path in dashboards:
        d = json.loads(path.read_text())
        uids.add(d["uid"])
        assert "model_name" in [v["name"] for v in d["templating"]["list"]], path.name
        for panel in d["panels"]:
            assert panel["targets"], f"{path.name}: {panel['title']} has no query"
            for t in panel["targets"]:
                expr = t["expr"]
                if "kvmesh:" in expr:
                    assert 'model_name=~"$model_name"' in expr, (path.name, panel["title"])
                assert _used(expr) <= documented, (path.name, _used(expr) - documented)
    assert len(uids) == 3


def test_alert_rules_use_only_documented_metrics():
    documented = _documented()
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "kvmesh-alerts.yml").read_text())
    names = [r["alert"] for g in rules["groups"] for r in g["rules"]]
    assert {"KvmeshTargetDown", "KvmeshTTFTAboveSLO", "KvmeshKVCacheSaturated",
            "KvmeshTierDown"} <= set(names)  # fmt: skip
    for g in rules["groups"]:
        for r in g["rules"]:
            assert _used(r["expr"]) <= documented, (r["alert"], _used(r["expr"]) - documented)
            assert r["alert"] in (ROOT / "docs" / "metrics.md").read_text()


def test_cli_metrics_flags():
    from kvmesh.cluster.cli import build_parser
    from kvmesh.cluster.serve import ClusterConfig, config_from_args

    p = build_parser()
    a = p.parse_args(["serve", "--metrics-port", "9400", "--prometheus-sd-file", "/tmp/sd.json"])
    cfg = config_from_args(a)
    assert (cfg.metrics_port, cfg.prometheus_sd_file) == (9400, "/tmp/sd.json")
    assert p.parse_args(["worker", "--metrics-port", "0"]).metrics_port == 0
    assert p.parse_args(["top", "--address", "h:9400"]).address == "h:9400"
    with pytest.raises(ValueError, match="prometheus_sd_file needs metrics_port"):
        ClusterConfig(prometheus_sd_file="/tmp/sd.json")
    with pytest.raises(ValueError, match="metrics_port"):
        ClusterConfig(metrics_port=70000)


def test_router_server_checks_the_discovery_file_folder(tmp_path):
    from kvmesh.router.service import RouterServer

    with pytest.raises(ValueError, match="prometheus_sd_file .*no such directory"):
        RouterServer(RouterCore(), prometheus_sd_file=str(tmp_path / "nope" / "sd.json"))
    srv = RouterServer(RouterCore(), metrics_port=0, prometheus_sd_file=str(tmp_path / "sd.json"))
    srv.start_in_thread()
    try:
        core = srv.core
        srv.call(core.register, _info("a", [], metrics_address="10.0.0.1:9000"))
        srv.call(srv._write_sd_file)
        groups = json.loads((tmp_path / "sd.json").read_text())
        assert groups[0] == {"targets": [srv.metrics_address], "labels": {"kvmesh_role": "router"}}
        assert groups[1]["targets"] == ["10.0.0.1:9000"]
        assert groups[1]["labels"]["kvmesh_role"] == "worker"
    finally:
        srv.stop_in_thread(grace=0)


def test_top_scrapes_in_order_at_most_eight_at_once_and_raises_their_errors():
    import threading
    import time as _time

    from kvmesh.cluster.top import SCRAPES_AT_ONCE, _in_daemon_threads

    lock, now, peak = threading.Lock(), [0], [0]

    def scrape(x):
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])
        _time.sleep(0.01)
        with lock:
            now[0] -= 1
        return 2 * x

    assert _in_daemon_threads(scrape, list(range(20))) == [2 * x for x in range(20)]
    assert 1 < peak[0] <= SCRAPES_AT_ONCE

    def bad(x):
        if x == 3:
            raise ValueError("not a metrics page")
        return x

    with pytest.raises(ValueError, match="not a metrics page"):
        _in_daemon_threads(bad, list(range(5)))


def test_top_makes_ctrl_c_work_and_puts_the_old_handler_back():
    import signal

    from kvmesh.cluster.top import _ctrl_c_exits

    old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # started from `cmd &`
    try:
        restore = _ctrl_c_exits()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        restore()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, old)
