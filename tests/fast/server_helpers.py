"""Helpers shared by the server tests: the app as `pagedlm.server.run`
wires it, over a tiny model, and readers of its answers."""

from __future__ import annotations

from contextlib import contextmanager

from prometheus_client.parser import text_string_to_metric_families

from pagedlm.batch.engine import LLMEngine
from pagedlm.options import EngineOptions, ServerOptions
from pagedlm.server.app import build_app
from pagedlm.server.loop import EngineLoop
from pagedlm.server.metrics import Metrics
from pagedlm.server.planner import Planner

MAX_MODEL_LEN = 64


def make_app(model, tokenizer, *, paged_kv=None, api_key=None, max_model_len=MAX_MODEL_LEN,
             kv_budget_bytes=None, **server):
    """The app and its planner, as `pagedlm.server.run` wires them; ``server``:
    more `ServerOptions` fields (served_model_name, seed, chat_template, CORS).
    The app's engine loop is ``app.state.engine_loop``: ``close()`` it to
    stop its thread (`pagedlm.server.run` does as the server stops)."""
    engine = LLMEngine(model, tokenizer, EngineOptions(paged_kv=paged_kv, max_model_len=max_model_len,
                                                       kv_budget_bytes=kv_budget_bytes,
                                                       prompt_cache_bytes=0 if paged_kv else 1 << 24))
    options = ServerOptions(model="tiny", api_key=api_key, **server)
    metrics = Metrics(model_name=options.model_names[0])
    lane = EngineLoop(engine, max_queue=4, metrics=metrics)
    planner = Planner(engine, list(options.model_names), default_seed=options.seed,
                      chat_template=options.chat_template)
    metrics.bind(engine, lambda: lane.depth)
    app = build_app(planner, lane, metrics, options)
    app.state.engine_loop = lane
    return app, planner


@contextmanager
def serving(model, tokenizer, **app_options):
    """(client, planner) of `make_app`'s app under a TestClient, its engine loop closed after."""
    from fastapi.testclient import TestClient

    app, planner = make_app(model, tokenizer, **app_options)
    try:
        with TestClient(app) as client:
            yield client, planner
    finally:
        app.state.engine_loop.close()


def metric(client, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"{name} {labels} is not in /metrics")


def error_of(r, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    return error
