"""What an operator reads in README.md and docs/deploy.md names what the code has.

Each test reads the documents as they are and checks the names in them against the
code: metric names, types and labels against the metrics the code registers; endpoint
paths against the serving and admin apps' routes; the reload lists against
``gateway.settings_diff``; ``KVGATE_*`` names against the settings; ``kvgate`` flags
against the CLI's parsers; what the overlay table says each overlay runs against
``kubectl kustomize``. A name changed on one side only fails here.
"""

from __future__ import annotations

import argparse
import ast
import functools
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from cli.main import build_parser
from gateway.app import create_app
from gateway.config import Settings
from gateway.environment import TOOL_VARIABLES, check_environment, is_service_link, setting_names
from gateway.settings_diff import RESTART_ONLY

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DEPLOY_MD = (ROOT / "docs" / "deploy.md").read_text()
DOCS = {"README.md": README, "docs/deploy.md": DEPLOY_MD}
METRIC_KINDS = {"Counter", "Gauge", "Histogram", "Summary"}


# --- metrics ---------------------------------------------------------------------


@functools.cache
def registered_metrics() -> dict[str, dict[str, Any]]:
    """Every ``kvgate_*`` metric the code constructs, by its exposition name (a
    counter's with ``_total``): its type, label names and multiprocess mode."""
    found: dict[str, dict[str, Any]] = {}
    for package in ("gateway", "kvindex", "routing"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Call) or not node.args:
                    continue
                func = node.func
                kind = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                first = node.args[0]
                if kind not in METRIC_KINDS or not isinstance(first, ast.Constant):
                    continue
                name = first.value
                if not (isinstance(name, str) and name.startswith("kvgate_")):
                    continue
                keywords = {k.arg: k.value for k in node.keywords}
                labels_node = node.args[2] if len(node.args) > 2 else keywords.get("labelnames")
                labels = (
                    {e.value for e in labels_node.elts if isinstance(e, ast.Constant)}
                    if isinstance(labels_node, ast.List | ast.Tuple)
                    else set()
                )
                mode = keywords.get("multiprocess_mode")
                if kind == "Counter" and not name.endswith("_total"):
                    name += "_total"
                found[name] = {
                    "type": kind.lower(),
                    "labels": labels,
                    "mode": mode.value if isinstance(mode, ast.Constant) else None,
                    "where": path.relative_to(ROOT).as_posix(),
                }
    return found


def _without_parentheses(text: str) -> str:
    while True:
        stripped = re.sub(r"\([^()]*\)", "", text)
        if stripped == text:
            return text
        text = stripped


@functools.cache
def readme_metric_rows() -> dict[str, tuple[str, set[str]]]:
    """README's Metrics table: each name's type and label names as documented."""
    section = README.split("\n## Metrics", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, tuple[str, set[str]]] = {}
    for line in section.splitlines():
        if not line.startswith("| `kvgate_"):
            continue
        names_cell, types_cell, labels_cell = [c.strip() for c in line.strip("|").split("|")]
        names = re.findall(r"`(kvgate_[a-z0-9_]+)`", names_cell)
        types = [t.strip() for t in types_cell.split(",")]
        labels = [part.strip() for part in _without_parentheses(labels_cell).split(";")]
        for i, name in enumerate(names):
            kind = types[i] if len(types) == len(names) else types[0]
            label_text = labels[i] if len(labels) == len(names) else labels[0]
            label_set = {x.strip() for x in label_text.split(",")} - {"—", ""}
            rows[name] = (kind, label_set)
    return rows


def deploy_md_discovery_metrics() -> set[str]:
    """The discovery metrics, which deploy.md lists (step 2) and README's table does not:
    a plain gateway registers none of them, and the integration tests expect every
    name in README's Metrics section on a plain gateway's ``/metrics``."""
    return set(re.findall(r"`(kvgate_discovery_[a-z0-9_]+)[`{]", DEPLOY_MD))


def test_every_metric_the_code_registers_is_documented_and_back():
    table = set(readme_metric_rows())
    documented = table | deploy_md_discovery_metrics()
    registered = set(registered_metrics())
    assert len(table) >= 40
    assert not any(n.startswith("kvgate_discovery_") for n in table)
    undocumented = {n: registered_metrics()[n]["where"] for n in registered - documented}
    assert undocumented == {}, "registered, but in neither README's table nor deploy.md"
    assert documented - registered == set(), "documented but never registered"
    assert registered_metrics()["kvgate_discovery_pods"]["type"] == "gauge"
    assert "the gauge `kvgate_discovery_pods`" in DEPLOY_MD


def test_readme_metric_types_and_labels_are_what_the_code_registers():
    wrong = {}
    for name, (kind, labels) in readme_metric_rows().items():
        code = registered_metrics().get(name)
        if code is not None and (code["type"], code["labels"]) != (kind, labels):
            wrong[name] = {"readme": (kind, sorted(labels)),
                           "code": (code["type"], sorted(code["labels"]))}  # fmt: skip
    assert wrong == {}


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_metric_names_and_label_selectors_in_the_prose_exist(doc):
    """``kvgate_x_total{label="value"}`` anywhere in a document: the metric and labels exist."""
    mentions = re.findall(r"(kvgate_[a-z0-9_]+)(?:\{([^}]*)\})?", DOCS[doc])
    assert len(mentions) >= 5
    wrong = []
    for name, selector in mentions:
        if name.endswith("_"):  # a prefix, as in "`kvgate_admission_*`"
            continue
        code = registered_metrics().get(name)
        labels = {part.split("=")[0].strip() for part in selector.split(",") if part.strip()}
        if code is None or not labels <= code["labels"]:
            wrong.append(f"{name}{{{selector}}}")
    assert wrong == []


def _readme_gauge_mode(name: str) -> str:
    # README, Metrics: with --workers, the gauges it names are summed, the others are
    # the largest live worker's value (kvgate_index_redis_up the smallest).
    section = README.split("\n## Metrics", 1)[1].split("\n## ", 1)[0]
    summed = re.search(r"histograms summed, (.*?) summed,\s+the\s+other\s+gauges", section, re.S)
    smallest = re.search(r"\(`(kvgate_[a-z_]+)` the smallest\)", section)
    assert summed and smallest, "README no longer says how gauges combine over workers"
    if name in re.findall(r"`(kvgate_[a-z_]+)`", summed.group(1)):
        return "livesum"
    return "livemin" if name == smallest.group(1) else "livemax"


GAUGES = sorted(n for n, m in registered_metrics().items() if m["type"] == "gauge")


@pytest.mark.parametrize("name", GAUGES)
def test_each_gauge_combines_over_workers_as_the_readme_says(name):
    assert registered_metrics()[name]["mode"] == _readme_gauge_mode(name)


# --- endpoints -------------------------------------------------------------------


@functools.cache
def apps() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(serving routes, admin routes): path -> methods, from the real apps."""
    app = create_app(Settings(pods=[{"name": "a", "url": "http://127.0.0.1:9"}]))

    def routes(a: Any) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for r in a.routes:
            out.setdefault(r.path, set()).update(getattr(r, "methods", None) or set())
        return out

    return routes(app), routes(app.state.admin_app)


def _usage_endpoints() -> list[tuple[str, str]]:
    """``(METHOD, path)`` for every endpoint README's Usage section lists, aliases
    ("`POST /v1/score` (and `/score`)") with their method."""
    usage = README.split("Endpoints routed by what the pods have cached", 1)[1]
    usage = usage.split("\nEvery answer on the API paths above", 1)[0]
    found = []
    pattern = r"`(GET|POST) (/[^`\s?]+)[^`]*`( \(and ((?:`/[^`]+`(?:, )?)+)\))?"
    for method, path, _, aliases in re.findall(pattern, usage):
        found.append((method, path))
        found += [(method, alias) for alias in re.findall(r"`(/[^`]+)`", aliases or "")]
    return found


def test_readme_serving_endpoints_are_the_serving_apps_routes():
    serving, admin = apps()
    documented = [(m, p) for m, p in _usage_endpoints() if not p.startswith("/admin/")]
    not_proxied = [(m, p) for m, p in documented if "{" in p]
    assert not_proxied == [("GET", "/v1/responses/{id}")]  # "is not proxied"
    routed = [(m, p) for m, p in documented if "{" not in p]
    assert len(routed) >= 20
    missing = [(m, p) for m, p in routed if m not in serving.get(p, set())]
    assert missing == []
    assert not any(p.startswith("/v1/responses/") for p in serving)
    # ... and README lists every path the serving port answers.
    assert set(serving) - {p for _, p in routed} == set()
    # deploy.md, LoRA adapters: kvgate does not forward these two calls.
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} & set(serving) == set()


def test_readme_admin_endpoints_are_on_the_admin_listener_only():
    serving, admin = apps()
    documented = [(m, p) for m, p in _usage_endpoints() if p.startswith("/admin/")]
    assert len(documented) == 6
    assert [(m, p) for m, p in documented if m not in admin.get(p, set())] == []
    assert [p for p in serving if p.startswith("/admin")] == []
    assert {p for p in admin if p.startswith("/admin/")} == {p for _, p in documented}


def _security_row(listener: str) -> str:
    table = DEPLOY_MD.split("\n## Security", 1)[1]
    (row,) = [line for line in table.splitlines() if line.startswith(f"| {listener} (")]
    return row.split("|")[3]


def test_deploy_md_security_table_lists_the_routes_of_each_listener():
    serving, admin = apps()
    admin_paths = set(re.findall(r"`(/[^`]+)`", _security_row("admin")))
    assert admin_paths == set(admin)
    serving_cell = _security_row("serving")
    missing = []
    for path, suffix in re.findall(r"`(/[^`]+)`(?: \(and `(/[^`]+)`\))?", serving_cell):
        for p in [path] + ([path + suffix] if suffix else []):
            if p not in serving:
                missing.append(p)
    assert missing == []
    assert not set(re.findall(r"`(/admin[^`]*)`", serving_cell))


# --- settings: reload lists and environment variables ----------------------------


def _reloading_section() -> tuple[str, str]:
    section = README.split("\n### Reloading", 1)[1].split("\nFailure handling:", 1)[0]
    changes = section.split("What a reload changes", 1)[1].split("What **needs a restart**")[0]
    restart = section.split("What **needs a restart**", 1)[1].split(": the listeners", 1)[0]
    return changes, restart


def _names(text: str) -> set[str]:
    return {n for n in re.findall(r"`([^`\s]+)`|\*\*([^*\s]+)\*\*", text) for n in n if n}


def test_readme_restart_list_is_the_codes():
    _, restart = _reloading_section()
    documented = {n for n in _names(restart) if re.fullmatch(r"[a-z_.]+", n)}
    assert documented == set(RESTART_ONLY)


def test_readme_reload_section_names_every_setting_once_on_the_right_side():
    changes, restart = _reloading_section()
    named = _names(changes) | _names(restart)
    unnamed = []
    for field, info in Settings.model_fields.items():
        section = info.annotation
        subfields = getattr(section, "model_fields", None) if isinstance(section, type) else None
        if field in named:
            continue
        if subfields and all(f"{field}.{key}" in named for key in subfields):
            continue
        unnamed.append(field)
    assert unnamed == [], "README, Reloading, says neither that these reload nor that they don't"
    top = set(Settings.model_fields)
    said_to_reload = {n for n in _names(changes) if n.split(".")[0] in top}
    restart_only = {
        n for n in said_to_reload if any(n == r or n.startswith(r + ".") for r in RESTART_ONLY)
    }
    assert restart_only == set()


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_kvgate_variable_in_the_docs_is_a_setting_a_tool_variable_or_a_link(doc):
    text = DOCS[doc]
    names = re.findall(r"(KVGATE_[A-Z0-9_]*[A-Z0-9])(?:=(\S+?))?[`\s,)]", text)
    # "`…__KV_EVENTS_PORT`" after "`KVGATE_DISCOVERY__DEFAULT_PORT`": same section.
    for short in re.findall(r"`…(__[A-Z0-9_]+)`", text):
        names.append(("KVGATE_DISCOVERY" + short, ""))
    assert len(names) >= 3
    settings = set(setting_names(Settings))
    wrong = []
    for name, value in names:
        if name == "KVGATE_STRATGY":  # README's example of a misspelt one: refused
            with pytest.raises(ValueError) as refused:
                check_environment({name: "kv-aware"}, Settings)
            assert "KVGATE_STRATGY is not a setting (did you mean KVGATE_STRATEGY?)" in str(
                refused.value
            )
            assert refused.value.args[0] in README
            continue
        if value.startswith("tcp://") or name.endswith("_SERVICE_HOST"):
            if "<" in value:  # "KVGATE_PORT=tcp://<cluster IP>:80"
                value = "tcp://10.96.0.12:80"
            ok = is_service_link(name, value or "10.96.0.12")
        else:
            ok = name in settings or name in TOOL_VARIABLES
        if not ok:
            wrong.append(name)
    assert wrong == []


# --- command-line flags ----------------------------------------------------------


def _options(parser: argparse.ArgumentParser) -> set[str]:
    out: set[str] = set()
    for action in parser._actions:
        out.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _options(sub)
    return out


def _parser_for(words: list[str]) -> argparse.ArgumentParser:
    parser = build_parser(words[0])
    for word in words:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return parser


# A row of README's command table that describes another command's runs: the seeds
# row's `--seed` and `--out` are those of the fleet runs it reads.
ROW_ALSO = {("bench", "seeds"): ("bench", "fleet")}


def _command_spans(text: str) -> list[str]:
    """Text that follows ``kvgate <command>``: a code block's command with its continued
    lines, an inline code span, or a table row that starts with one."""
    spans = []
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    prose = re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S)
    for block in blocks:
        spans += block.replace("\\\n", " ").splitlines()
    rows = [line for line in prose.splitlines() if line.startswith("| `kvgate ")]
    spans += rows
    prose = "\n".join(line for line in prose.splitlines() if line not in rows)
    spans += re.findall(r"`([^`]+)`", prose)
    return spans


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_kvgate_flag_in_the_docs_is_a_flag_of_that_command(doc):
    checked = 0
    wrong = []
    for span in _command_spans(DOCS[doc]):
        m = re.search(r"\bkvgate (serve|sim|index|bench ([a-z-]+))\b", span)
        if m is None:
            continue
        words = m.group(1).split()
        options = _options(_parser_for(words))
        if span.startswith("| ") and tuple(words) in ROW_ALSO:
            options |= _options(_parser_for(list(ROW_ALSO[tuple(words)])))
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", span[m.end() :]):
            checked += 1
            if flag not in options:
                wrong.append(f"kvgate {' '.join(words)} {flag}")
    assert checked >= 5
    assert wrong == []


# --- deploy/: what the overlays build --------------------------------------------


@functools.cache
def built(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (its built-in kustomize builds the overlays)")
    out = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "deploy" / "overlays" / overlay)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return [d for d in yaml.safe_load_all(out) if d]


def _objects(docs: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {(d["kind"], d["metadata"]["name"]) for d in docs}


def _overlay_table() -> dict[str, str]:
    table = DEPLOY_MD.split("| overlay (`deploy/overlays/…`) |", 1)[1].split("\n\n", 1)[0]
    return dict(re.findall(r"^\| `([a-z-]+)` \| (.+) \|$", table, flags=re.M))


# What each row of deploy.md's overlay table says, as objects present and absent.
OVERLAY_PROMISES = {
    "native": ({("Deployment", "vllm"), ("Deployment", "kvgate-redis"),
                ("Deployment", "kvgate"), ("ServiceMonitor", "kvgate")}, set()),
    "lmcache": ({("Deployment", "vllm"), ("ConfigMap", "lmcache-config"),
                 ("Deployment", "kvgate-redis"), ("Deployment", "kvgate")}, set()),
    "sidecar": ({("Deployment", "vllm"), ("Service", "kvgate")}, {("Deployment", "kvgate")}),
    "managed-redis": ({("Deployment", "kvgate"), ("Deployment", "vllm")},
                      {("Deployment", "kvgate-redis")}),
    "hyperpod": ({("InferenceEndpointConfig", "qwen2-7b"), ("Deployment", "kvgate")},
                 {("Deployment", "vllm")}),
}  # fmt: skip


def test_deploy_md_overlay_table_lists_every_overlay():
    on_disk = {p.name for p in (ROOT / "deploy" / "overlays").iterdir() if p.is_dir()}
    assert set(_overlay_table()) == on_disk == set(OVERLAY_PROMISES)


@pytest.mark.parametrize("overlay", sorted(OVERLAY_PROMISES))
def test_each_overlay_builds_what_deploy_md_says_it_runs(overlay):
    docs = built(overlay)
    present, absent = OVERLAY_PROMISES[overlay]
    assert present <= _objects(docs)
    assert absent & _objects(docs) == set()
    if "2 kvgate replicas" in _overlay_table()[overlay]:
        (gateway,) = [d for d in docs if (d["kind"], d["metadata"]["name"]) == (
            "Deployment", "kvgate")]  # fmt: skip
        assert gateway["spec"]["replicas"] == 2
    if overlay == "sidecar":
        (vllm,) = [d for d in docs if (d["kind"], d["metadata"]["name"]) == (
            "Deployment", "vllm")]  # fmt: skip
        names = [c["name"] for c in vllm["spec"]["template"]["spec"]["containers"]]
        assert "kvgate" in names  # "kvgate inside every vLLM pod"


def test_managed_redis_overlay_feeds_the_secret_to_the_redis_url():
    # deploy.md: "The overlay feeds the Secret to `KVGATE_INDEX__REDIS_URL`".
    assert "feeds the Secret to\n`KVGATE_INDEX__REDIS_URL`" in DEPLOY_MD
    (gateway,) = [d for d in built("managed-redis") if (d["kind"], d["metadata"]["name"]) == (
        "Deployment", "kvgate")]  # fmt: skip
    (container,) = [c for c in gateway["spec"]["template"]["spec"]["containers"]
                    if c["name"] == "kvgate"]  # fmt: skip
    (env,) = [e for e in container["env"] if e["name"] == "KVGATE_INDEX__REDIS_URL"]
    assert env.get("valueFrom") == {"secretKeyRef": {"name": "kvgate-redis", "key": "url"}}
    assert "value" not in env  # Kubernetes: "may not be specified when `value` is not empty"
