"""Deployment files, checked without Docker, Kubernetes, Prometheus or a GPU.

No Docker engine runs on our machines, so this checks what can be checked here, with well-kept
validators from the test extra (pyproject.toml):

- docker/Dockerfile: hadolint (the Dockerfile linter), plus structure: the pinned NGC Triton base
  matching the Triton the tests use, a non-root USER, the health check, the ports, the entrypoint,
  and the install step being scripts/install.sh, the script the Makefile runs (exercised here in
  its --system mode with a stand-in Python).
- docker/compose.yaml: the compose-spec JSON schema (check-jsonschema's vendored copy), plus
  GPU reservation, mounts that exist, Prometheus scraping the metrics port, Grafana provisioning
  that points at the dashboard folder and the datasource the dashboard names.
- docker/k8s: every manifest against the Kubernetes OpenAPI schemas (kubernetes-validate, strict:
  unknown fields fail) for an older and the newest bundled release, plus the wiring between them
  (selectors, named ports, probes, the ConfigMap's engine.json, GPU count vs device placement).
- docker/grafana/dashboards/nightdraft.json: every panel's PromQL parses (promql-parser) and
  names only metric families, label names and label values that the model actually exports
  (read by running backend.serving.metrics against a stand-in pb_utils); rate() only on counters
  and histogram series, histogram_quantile() only on buckets.
- the engine configurations the deployment ships load through backend.engine.config.
- scripts/gpu_check.sh: shellcheck; --dry-run exits 0 within seconds; bad input is refused; and a
  run against a stand-in GPU (nvidia-smi, torch and CLI faked) writes its JSON and summary.
- security defaults: the launcher's command listens on 127.0.0.1 and restricts Triton's
  administrative APIs behind a key; the image and the Deployment listen on every interface on
  purpose and take the key from the environment (a Secret); compose publishes on loopback, and
  Grafana needs a password and allows no anonymous access. One real tritonserver (slow) shows an
  unload refused without the key and accepted with it, and no port answering off loopback.
"""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
K8S = DOCKER / "k8s"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "nightdraft.json"
GPU_CHECK = REPO / "scripts" / "gpu_check.sh"
INSTALL = REPO / "scripts" / "install.sh"

# The NGC release whose Triton the project tests against (nvidia-pytriton 0.7.0 ships 2.51).
NGC_TRITON = {"24.10": "2.51"}
IMAGE_UID = 10001


def tool(name: str) -> str:
    """A validator's executable from the test extra: next to this Python, else on PATH."""
    for cand in (Path(sys.executable).parent / name, shutil.which(name)):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return str(cand)
    pytest.fail(f"{name} not found: it comes with the test extra (scripts/install.sh .venv serve,test,bench)")


def run(cmd, timeout=60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


# ============================================================================== Dockerfile


def dockerfile_instructions(path: Path = DOCKER / "Dockerfile") -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, continuation lines joined."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1].strip() + " "
            continue
        buf += stripped
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, "the Dockerfile ends in a continuation line"
    return out


def test_dockerfile_passes_hadolint():
    res = run([tool("hadolint"), "--no-color", str(DOCKER / "Dockerfile")])
    assert res.returncode == 0, f"hadolint:\n{res.stdout}{res.stderr}"


def test_dockerfile_structure():
    ins = dockerfile_instructions()
    froms = [a for i, a in ins if i == "FROM"]
    assert len(froms) == 1, froms
    image, _, tag = froms[0].partition(":")
    assert image == "nvcr.io/nvidia/tritonserver", froms[0]
    m = re.fullmatch(r"(\d\d\.\d\d)-py3", tag)
    assert m, f"FROM must pin an NGC release tag like 24.10-py3, got {froms[0]!r}"
    assert m.group(1) in NGC_TRITON, f"{tag}: not the Triton release the tests use ({NGC_TRITON})"

    users = [a for i, a in ins if i == "USER"]
    assert users, "no USER: the server would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), users[-1]
    assert user == str(IMAGE_UID), "k8s runAsNonRoot needs a numeric USER (and deployment.yaml uses it)"
    assert any(i == "RUN" and "useradd" in a and f"--uid {IMAGE_UID}" in a for i, a in ins)

    checks = [a for i, a in ins if i == "HEALTHCHECK"]
    # The model, not only the server, and never through an http_proxy the environment may set.
    assert len(checks) == 1 and "/v2/models/nightdraft/ready" in checks[0] and ":8000" in checks[0], checks
    assert "ProxyHandler({})" in checks[0], checks

    exposed = {p for i, a in ins if i == "EXPOSE" for p in a.split()}
    assert {"8000", "8001", "8002"} <= exposed, exposed

    entry = [json.loads(a) for i, a in ins if i == "ENTRYPOINT"]
    assert entry == [["nightdraft", "serve"]], entry
    cmd = json.loads([a for i, a in ins if i == "CMD"][-1])
    workdir = [a for i, a in ins if i == "WORKDIR"][-1]
    repo_arg = cmd[cmd.index("--model-repository") + 1]
    assert repo_arg == f"{workdir}/model_repository", (repo_arg, workdir)
    for model in (cmd[i + 1] for i, a in enumerate(cmd) if a == "--model"):
        assert (REPO / "model_repository" / model / "config.pbtxt").is_file(), f"--model {model}: no such model"


def top_level_packages() -> set[str]:
    """The top-level packages pyproject.toml installs (a list, or find's include patterns)."""
    import tomllib
    st = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = st.get("packages")
    names = packages if isinstance(packages, list) else packages["find"]["include"]
    tops = {n.rstrip("*").split(".")[0] for n in names}
    assert tops and all(t.isidentifier() for t in tops), names
    return tops


def test_dockerfile_copies_what_the_install_needs():
    ins = dockerfile_instructions()
    copied = set()
    for i, a in ins:
        if i != "COPY":
            continue
        parts = [p for p in a.split() if not p.startswith("--")]
        for src in parts[:-1]:
            if any(c in src for c in "*?["):
                continue   # optional files (README*)
            assert (REPO / src).exists(), f"COPY {src}: not in the repository"
            copied.add(src.rstrip("/"))
    needed = top_level_packages()
    needed |= {"pyproject.toml", "scripts", "model_repository", "models"}
    assert needed <= copied, f"not copied into the image: {sorted(needed - copied)}"


def test_image_and_makefile_share_the_install_script():
    make = (REPO / "Makefile").read_text()
    assert re.search(r"^\tscripts/install\.sh \$\(VENV\) ", make, re.M), "the Makefile no longer runs scripts/install.sh"
    runs = [a for i, a in dockerfile_instructions() if i == "RUN" and "scripts/install.sh" in a]
    assert len(runs) == 1, "the image must install with scripts/install.sh, once"
    assert re.search(r"(^|\s)scripts/install\.sh --system ", runs[0]), runs[0]
    assert not re.search(r"\bpip3? install\b", " ".join(a for i, a in dockerfile_instructions() if i == "RUN")), \
        "the image installs packages outside scripts/install.sh"


def test_install_script_system_mode(tmp_path):
    """The image's path through install.sh, with a stand-in python3 that records what it is asked."""
    log = tmp_path / "calls.log"
    fake = tmp_path / "python3"
    fake.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        echo "$*" >> {log}
        case "$*" in *sys.prefix*) echo /usr ;; esac
        exit 0
    """))
    fake.chmod(0o755)
    res = run(["bash", str(INSTALL), "--system", "serve,bench"], env={**os.environ, "PYTHON": str(fake)})
    assert res.returncode == 0, res.stdout + res.stderr
    calls = log.read_text().splitlines()
    assert any(c.startswith("-m pip install") and "--upgrade pip" in c for c in calls), calls
    assert any(c.startswith("-m pip install") and "-e .[serve,bench]" in c for c in calls), calls
    assert not any("venv" in c for c in calls), "--system must not create a virtual environment"
    assert "system Python" in res.stdout


def test_shell_scripts_pass_shellcheck():
    res = run([tool("shellcheck"), str(GPU_CHECK), str(INSTALL)])
    assert res.returncode == 0, res.stdout + res.stderr


def test_triton_versions_agree():
    """Image, wheel and client are the same Triton release."""
    pyproject = (REPO / "pyproject.toml").read_text()
    tag = dockerfile_instructions()[0][1].split(":")[1].removesuffix("-py3")
    triton = NGC_TRITON[tag]
    assert re.search(rf'"tritonclient\[[^\]]*\]=={re.escape(triton)}\.\d+"', pyproject), \
        f"tritonclient is not pinned to Triton {triton}"
    assert '"numpy>=1.24,<2"' in pyproject, "the 2.51 Python backend stub needs numpy < 2"


def test_sources_parse_as_python_310():
    """NGC 24.10's Python (which the image's Python backend stub embeds) is 3.10."""
    bad = []
    for top in ("backend", "planner", "client", "model_repository"):
        for path in (REPO / top).rglob("*.py"):
            try:
                ast.parse(path.read_text(), filename=str(path), feature_version=(3, 10))
            except SyntaxError as e:
                bad.append(f"{path.relative_to(REPO)}:{e.lineno}: {e.msg}")
    assert not bad, "\n".join(bad)


# ============================================================================== engine configs


def engine_configs() -> dict[str, dict]:
    out = {p.name: json.loads(p.read_text()) for p in sorted(DOCKER.glob("engine*.json"))}
    cm = yaml.safe_load((K8S / "configmap.yaml").read_text())
    out["k8s/configmap.yaml"] = json.loads(cm["data"]["engine.json"])
    return out


@pytest.mark.parametrize("name", list(engine_configs()))
def test_shipped_engine_configs_load(name, tmp_path):
    from backend.engine.config import EngineConfig
    raw = dict(engine_configs()[name])
    for key in ("target", "drafter"):   # paths inside the container: stand-ins here
        if raw.get(key):
            assert raw[key].startswith("/"), f"{name}: {key} must be absolute inside the container"
            (tmp_path / key).mkdir()
            (tmp_path / key / "config.json").write_text("{}")
            raw[key] = str(tmp_path / key)
    cfg = EngineConfig.from_dict(raw)
    assert cfg.device.startswith("cuda"), f"{name}: a GPU deployment config on {cfg.device}"
    assert cfg.dtype == "bfloat16", f"{name}: bf16 is the GPU default"


def test_tiny_pair_paths_match_the_image():
    workdir = [a for i, a in dockerfile_instructions() if i == "WORKDIR"][-1]
    for name, raw in engine_configs().items():
        for key in ("target", "drafter"):
            path = raw.get(key)
            if path and path.startswith(workdir + "/"):
                rel = path[len(workdir) + 1:]
                assert rel.startswith("models/"), f"{name}: {key} {path} is outside the copied models/"


# ============================================================================== compose


def load_compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def default_of(value: str) -> str:
    """`${VAR:-default}` -> default, as compose interpolates without the variable."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", value)


def test_compose_matches_the_compose_spec():
    res = run([tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(DOCKER / "compose.yaml")])
    assert res.returncode == 0, res.stdout + res.stderr


def test_compose_services():
    c = load_compose()
    services = c["services"]
    assert set(services) >= {"nightdraft", "prometheus", "grafana"}
    nd = services["nightdraft"]
    assert (DOCKER / nd["build"]["context"]).resolve() == REPO
    assert (REPO / nd["build"]["dockerfile"]).resolve() == (DOCKER / "Dockerfile").resolve()
    devices = nd["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices), devices
    assert {p.split(":")[-1] for p in nd["ports"]} >= {"8000", "8001", "8002"}
    assert nd.get("shm_size"), "the Python backend needs more than Docker's 64 MiB /dev/shm"
    for name, svc in services.items():
        image = svc.get("image", "")
        assert ":" in image and not image.endswith(":latest"), f"{name}: pin the image tag ({image!r})"
        for vol in svc.get("volumes", []):
            src = default_of(vol).split(":")[0]
            if src.startswith("."):
                assert (DOCKER / src).exists(), f"{name}: mount source {src} does not exist"


def test_compose_mounts_an_engine_config_over_the_models():
    nd = load_compose()["services"]["nightdraft"]
    workdir = [a for i, a in dockerfile_instructions() if i == "WORKDIR"][-1]
    mounts = {default_of(v).split(":")[1]: default_of(v).split(":")[0] for v in nd["volumes"]}
    target = f"{workdir}/model_repository/nightdraft/1/engine.json"
    assert target in mounts, mounts
    assert (REPO / "model_repository" / "nightdraft" / "1" / "engine.json").is_file()
    assert (DOCKER / mounts[target]).name in engine_configs()


def test_prometheus_scrapes_the_metrics_port():
    prom = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    targets = [t for job in prom["scrape_configs"] for sc in job.get("static_configs", [])
               for t in sc["targets"]]
    assert "nightdraft:8002" in targets, targets
    job = next(j for j in prom["scrape_configs"] if any("nightdraft:8002" in sc["targets"]
                                                         for sc in j.get("static_configs", [])))
    assert job.get("metrics_path", "/metrics") == "/metrics"
    mounts = [v.split(":")[:2] for v in load_compose()["services"]["prometheus"]["volumes"]]
    assert ["./prometheus.yml", "/etc/prometheus/prometheus.yml"] in mounts


def grafana_provisioning() -> tuple[dict, dict]:
    prov = DOCKER / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yaml").read_text())
    dash = yaml.safe_load((prov / "dashboards" / "nightdraft.yaml").read_text())
    return ds, dash


def test_grafana_provisioning():
    ds, dash = grafana_provisioning()
    (prom,) = [d for d in ds["datasources"] if d["type"] == "prometheus"]
    assert prom["url"] == "http://prometheus:9090"
    graf = load_compose()["services"]["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in graf["volumes"]}
    assert mounts.get("/etc/grafana/provisioning") == "./grafana/provisioning"
    (provider,) = dash["providers"]
    path = provider["options"]["path"]
    assert mounts.get(path) == "./grafana/dashboards", (path, mounts)
    assert (DOCKER / "grafana" / "dashboards" / "nightdraft.json").is_file()
    home = graf["environment"].get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    assert home == f"{path}/nightdraft.json"


# ============================================================================== dashboard


class _FakeMetric:
    def __init__(self, labels, buckets=None):
        self.labels, self.buckets = dict(labels), buckets

    def observe(self, v): pass
    def increment(self, v): pass
    def set(self, v): pass


class _FakeFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    created: dict[str, "_FakeFamily"] = {}

    def __init__(self, name, description, kind):
        self.name, self.kind, self.metrics = name, kind, []
        _FakeFamily.created[name] = self

    def Metric(self, labels, buckets=None):  # noqa: N802 (pb_utils' name)
        m = _FakeMetric(labels, buckets)
        self.metrics.append(m)
        return m


def exported_families() -> dict[str, _FakeFamily]:
    """What the model exports: backend.serving.metrics and vllm_metrics (REPORT_CUSTOM_METRICS is on
    in the model's config.pbtxt) run against a stand-in pb_utils, with the labels
    backend/serving/model.py gives them."""
    from types import SimpleNamespace

    from backend.serving.metrics import TritonMetrics
    from backend.serving.vllm_metrics import VllmMetrics
    _FakeFamily.created = {}
    pb = SimpleNamespace(MetricFamily=_FakeFamily)
    TritonMetrics(pb, {"model": "nightdraft", "version": "1"})
    VllmMetrics(pb, {"model": "nightdraft", "version": "1"}, max_model_len=1024, max_positions=8)
    assert _FakeFamily.created, "backend.serving.metrics defines no metric family"
    return dict(_FakeFamily.created)


HIST_SUFFIXES = ("_bucket", "_sum", "_count")
TARGET_LABELS = {"instance", "job"}      # added by Prometheus to every scraped series
PROM_BUILTIN = {"up"}                     # series Prometheus itself writes
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h",
                "$model": ".*", "$instance": ".*"}


def series_family(series: str, fams: dict) -> tuple[_FakeFamily | None, str]:
    """The family behind a series name, and which part of it ('' for the family itself)."""
    if series in fams:
        return fams[series], ""
    for suf in HIST_SUFFIXES:
        base = series.removesuffix(suf)
        if base != series and base in fams and fams[base].kind == _FakeFamily.HISTOGRAM:
            return fams[base], suf
    return None, ""


def dashboard_panels(d: dict) -> list[dict]:
    out = []
    for p in d["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def dashboard_exprs() -> list[tuple[str, str]]:
    d = json.loads(DASHBOARD.read_text())
    exprs = [(p["title"], t["expr"]) for p in dashboard_panels(d) for t in p.get("targets", [])]
    for v in d.get("templating", {}).get("list", []):
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", q or "")
        if m:
            exprs.append((f"variable {v['name']}", m.group(1)))
    return exprs


def substitute(expr: str) -> str:
    for k in sorted(GRAFANA_VARS, key=len, reverse=True):
        expr = expr.replace(k, GRAFANA_VARS[k])
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def test_dashboard_loads_and_is_well_formed():
    d = json.loads(DASHBOARD.read_text())
    assert d["uid"] == "nightdraft" and d["title"]
    panels = dashboard_panels(d)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    ds, _ = grafana_provisioning()
    uid = next(x["uid"] for x in ds["datasources"] if x["type"] == "prometheus")
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, f"{p['title']}: outside the 24-column grid"
        if p["type"] == "row":
            continue
        assert p["targets"], f"{p['title']}: no query"
        assert p["datasource"]["uid"] == uid, f"{p['title']}: datasource {p['datasource']} is not provisioned"
        for t in p["targets"]:
            assert t.get("datasource", p["datasource"])["uid"] == uid
            assert t["expr"].strip()
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            assert v["datasource"]["uid"] == uid


def test_dashboard_promql_uses_only_exported_metrics():
    import promql_parser as pp

    fams = exported_families()
    problems = []
    for title, expr in dashboard_exprs():
        try:
            ast_ = pp.parse(substitute(expr))
        except Exception as e:  # the parser's own error types
            problems.append(f"{title}: does not parse: {e}: {expr}")
            continue

        def visit(node, title=title, expr=expr):
            if isinstance(node, pp.VectorSelector):
                fam, part = series_family(node.name, fams)
                if fam is None:
                    if node.name not in PROM_BUILTIN:
                        problems.append(f"{title}: {node.name} is not exported by the model")
                    return
                label_sets = [m.labels for m in fam.metrics]
                known = set().union(*label_sets) | TARGET_LABELS | ({"le"} if part == "_bucket" else set())
                for m in node.matchers.matchers:
                    if m.name == "__name__":
                        continue
                    if m.name not in known:
                        problems.append(f"{title}: {fam.name} has no label {m.name!r}")
                    elif str(m.op).endswith("Equal") and "Not" not in str(m.op) and m.name not in TARGET_LABELS:
                        values = {ls.get(m.name) for ls in label_sets}
                        if m.value not in values:
                            problems.append(f"{title}: {fam.name}{{{m.name}={m.value!r}}} is never exported "
                                            f"(values: {sorted(v for v in values if v)})")
            elif isinstance(node, pp.Call):
                fname = node.func.name
                if fname in ("rate", "irate", "increase"):
                    sel = node.args[0].vector_selector
                    fam, part = series_family(sel.name, fams)
                    if fam is not None and not (fam.kind == _FakeFamily.COUNTER or part):
                        problems.append(f"{title}: {fname}() of the {fam.kind} {sel.name}")
                if fname == "histogram_quantile":
                    names = []
                    pp.walk(node.args[1], lambda n: names.append(n.name) if isinstance(n, pp.VectorSelector) else None)
                    for n in names:
                        fam, part = series_family(n, fams)
                        if fam is not None and part != "_bucket":
                            problems.append(f"{title}: histogram_quantile() over {n}, not a _bucket series")

        pp.walk(ast_, visit)
    assert not problems, "\n".join(problems)


def test_dashboard_covers_what_operators_need():
    """TTFT/TPOT, throughput, acceptance, gamma and mode over time, drafter state, KV usage."""
    used = set()
    for _, expr in dashboard_exprs():
        used |= set(re.findall(r"((?:\bnightdraft_|vllm:)[a-z0-9_:]+)", expr))
    fams = exported_families()
    used_fams = {series_family(s, fams)[0].name for s in used if series_family(s, fams)[0]}
    need = {
        "TTFT": "nightdraft_time_to_first_token_seconds",
        "TPOT": "nightdraft_time_per_output_token_seconds",
        "throughput": "nightdraft_generation_tokens_total",
        "acceptance": "nightdraft_spec_decode_accepted_tokens_total",
        "gamma": "nightdraft_spec_decode_gamma",
        "mode": "nightdraft_pipeline_mode",
        "drafter state": "nightdraft_drafter_state",
        "KV usage": "nightdraft_kv_cache_usage_ratio",
    }
    missing = {what: fam for what, fam in need.items() if fam not in used_fams}
    assert not missing, f"dashboard lacks {missing}"
    # The vllm:* families mirror nightdraft's for vLLM users' own dashboards: the coverage that
    # counts is of nightdraft's families.
    ours = {f for f in fams if f.startswith("nightdraft_")}
    unused = ours - used_fams
    assert len(used_fams & ours) >= len(ours) / 2, f"most exported families are not on the dashboard: {sorted(unused)}"
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in used_fams, "no acceptance-by-position panel"


# ============================================================================== Kubernetes

K8S_VERSIONS = ("1.29.0", None)   # an older supported release and the newest the validator bundles


def k8s_docs() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((str(path.relative_to(K8S)), doc))
    return docs


def k8s_kind(kind: str) -> dict:
    (doc,) = [d for _, d in k8s_docs() if d["kind"] == kind]
    return doc


@pytest.mark.parametrize("version", K8S_VERSIONS, ids=lambda v: v or "latest")
def test_k8s_manifests_match_the_kubernetes_schemas(version):
    import kubernetes_validate

    version = version or kubernetes_validate.latest_version()
    docs = k8s_docs()
    assert {d["kind"] for _, d in docs} >= {"Deployment", "Service", "ConfigMap", "HorizontalPodAutoscaler"}
    for name, doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except Exception as e:  # kubernetes_validate's and jsonschema's ValidationError
            where = list(getattr(e, "path", []))
            pytest.fail(f"{name} ({doc['kind']}) against Kubernetes {version}: {getattr(e, 'message', e)} at {where}")


def test_kustomization_lists_the_manifests():
    kz = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kz["resources"])
    for r in listed:
        assert (K8S / r).is_file(), f"kustomization: {r} missing"
    top = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == top, f"not in kustomization.yaml: {sorted(top - listed)}"


def test_k8s_deployment_wiring():
    dep, svc, cm = k8s_kind("Deployment"), k8s_kind("Service"), k8s_kind("ConfigMap")
    pod = dep["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items(), "the Service selects no pod"
    (c,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} == set(ports)

    # Every probe checks the model (ENABLE_VLLM_HEALTH_CHECK unloads a model whose engine cannot
    # serve), not only the server.
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["path"] == "/v2/models/nightdraft/ready", probe
    params = (REPO / "model_repository" / "nightdraft" / "config.pbtxt").read_text()
    assert re.search(r'key: "ENABLE_VLLM_HEALTH_CHECK"\s*value: \{ string_value: "true" \}', params)
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] in ("http", 8000), probe

    sc = pod["spec"]["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == IMAGE_UID

    # The engine configuration comes from the ConfigMap, over the file the image ships.
    workdir = [a for i, a in dockerfile_instructions() if i == "WORKDIR"][-1]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    (eng,) = [m for m in mounts.values() if m["mountPath"].endswith("/engine.json")]
    assert eng["mountPath"] == f"{workdir}/model_repository/nightdraft/1/engine.json"
    assert vols[eng["name"]]["configMap"]["name"] == cm["metadata"]["name"]
    assert eng["subPath"] in cm["data"]
    assert any(m["mountPath"] == "/dev/shm" for m in mounts.values())

    args = c["args"]
    assert args[args.index("--model-repository") + 1] == f"{workdir}/model_repository"
    assert dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "8002"


def test_k8s_gpus_cover_the_engine_placement():
    """nvidia.com/gpu: N shows the container GPUs cuda:0..N-1; engine.json must stay inside."""
    dep = k8s_kind("Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    gpus = int(c["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus == 2, "target and drafter each get a GPU"
    assert int(c["resources"]["requests"].get("nvidia.com/gpu", gpus)) == gpus
    engine = engine_configs()["k8s/configmap.yaml"]
    used = {engine["device"], engine.get("drafter_device") or engine["device"]}
    idx = {int(d.split(":")[1]) if ":" in d else 0 for d in used if d.startswith("cuda")}
    assert idx == {0, 1}, f"target on cuda:0, drafter on cuda:1; got {used}"
    assert max(idx) < gpus
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    for key in ("target", "drafter"):
        assert any(engine[key].startswith(m + "/") for m in mounts), f"{key} {engine[key]} is on no mounted volume"


def test_k8s_optional_autoscaler():
    hpa, dep, pdb = k8s_kind("HorizontalPodAutoscaler"), k8s_kind("Deployment"), k8s_kind("PodDisruptionBudget")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", dep["metadata"]["name"])
    assert hpa["spec"]["minReplicas"] <= dep["spec"]["replicas"] <= hpa["spec"]["maxReplicas"]
    fams = exported_families()
    for m in hpa["spec"]["metrics"]:
        name = m["pods"]["metric"]["name"]
        assert name in fams and fams[name].kind == _FakeFamily.GAUGE, name
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_model_instances_do_not_multiply_per_gpu():
    """KIND_GPU would start one engine per visible GPU (the drafter's GPU too)."""
    for cfg in (REPO / "model_repository").glob("*/config.pbtxt"):
        text = "\n".join(line.split("#")[0] for line in cfg.read_text().splitlines())
        assert not re.search(r"kind\s*:\s*KIND_GPU", text), f"{cfg.relative_to(REPO)}: use KIND_MODEL or KIND_CPU"


# ============================================================================== security defaults
#
# The launcher listens on loopback and keeps Triton's administrative APIs (model load/unload,
# shared memory, trace, logging) behind a key; the image and the manifests open the network on
# purpose and take the key from the environment (a Secret), never from the files here.

RESTRICTED = {"model-repository", "shared-memory", "trace", "logging"}
KEY = "0123456789abcdef0123456789abcdef"
# The headers docs/deployment.md tells operators to send (Triton prefixes the gRPC one).
ADMIN_HEADER = "nightdraft-admin-key"
GRPC_ADMIN_HEADER = "triton-grpc-protocol-nightdraft-admin-key"


def fake_tritonserver(tmp_path: Path) -> Path:
    """An executable to name: building a command needs no real server."""
    binary = tmp_path / "fake-triton" / "bin" / "tritonserver"
    binary.parent.mkdir(parents=True, exist_ok=True)
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(0o755)
    return binary


def restricted_flags(cmd: list[str]) -> dict[str, tuple[set[str], str, str]]:
    """{flag: (apis, header, key)} for Triton's --http-restricted-api / --grpc-restricted-protocol."""
    out = {}
    for arg in cmd:
        flag, _, value = arg.partition("=")
        if flag in ("--http-restricted-api", "--grpc-restricted-protocol"):
            apis, _, header_key = value.partition(":")
            header, _, key = header_key.partition("=")
            out[flag] = (set(apis.split(",")), header, key)
    return out


def serve_args(argv: list[str]):
    import argparse

    from client.launcher import add_serve_parser
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def serve_command(tmp_path: Path, argv: list[str], env: dict[str, str]):
    """The server `nightdraft serve ARGV` would start with environment ENV (a stand-in binary)."""
    from client.launcher import server_from_args
    repo = tmp_path / "repo"
    repo.mkdir(parents=True, exist_ok=True)
    args = serve_args([*argv, "--tritonserver", str(fake_tritonserver(tmp_path))])
    args.model_repository = str(repo)   # the container's path does not exist here
    return server_from_args(args, env=env)


def test_launcher_listens_on_loopback_by_default(tmp_path):
    from client.launcher import TritonServer
    server = TritonServer(tmp_path, tritonserver=fake_tritonserver(tmp_path), env={})
    cmd = server.command()
    for flag in ("--http-address", "--grpc-address", "--metrics-address"):
        assert f"{flag}=127.0.0.1" in cmd, cmd
    assert not any("0.0.0.0" in a for a in cmd), cmd


def test_serve_cli_listens_on_loopback_by_default():
    assert serve_args([]).host == "127.0.0.1"
    assert serve_args(["--host", "0.0.0.0"]).host == "0.0.0.0"


@pytest.mark.parametrize("models", [None, ["nightdraft"]], ids=["all-models", "explicit-models"])
def test_launcher_restricts_admin_apis_behind_a_key(tmp_path, models):
    from client.launcher import TritonServer
    server = TritonServer(tmp_path, tritonserver=fake_tritonserver(tmp_path), models=models,
                          env={"NIGHTDRAFT_ADMIN_KEY": KEY})
    cmd = server.command()
    flags = restricted_flags(cmd)
    assert set(flags) == {"--http-restricted-api", "--grpc-restricted-protocol"}, cmd
    for flag, (apis, header, key) in flags.items():
        assert apis >= RESTRICTED, (flag, apis)
        assert "inference" not in apis and "health" not in apis, "serving must stay open"
        assert (header, key) == (ADMIN_HEADER, KEY), flag
    assert server.admin_key == KEY
    assert ("--model-control-mode=explicit" in cmd) == (models is not None)


def test_admin_key_comes_from_the_environment_else_is_random(tmp_path):
    from client.launcher import LauncherError, TritonServer

    def server(env, **kw):
        return TritonServer(tmp_path, tritonserver=fake_tritonserver(tmp_path), env=env, **kw)

    from_env = server({"NIGHTDRAFT_ADMIN_KEY": KEY})
    assert from_env.admin_key == KEY
    assert restricted_flags(from_env.command())["--http-restricted-api"][2] == KEY
    assert server({"NIGHTDRAFT_ADMIN_KEY": KEY}, admin_key=KEY[::-1]).admin_key == KEY[::-1], \
        "--admin-key wins over the environment"
    # Unset or empty (compose's ${NIGHTDRAFT_ADMIN_KEY:-}): a fresh random key, so the APIs are closed.
    keys = [server({}).admin_key, server({"NIGHTDRAFT_ADMIN_KEY": ""}).admin_key]
    assert keys[0] != keys[1] and all(len(k) >= 32 for k in keys), keys
    for bad in ("short", "has space in it 1234", "with:colon=0123456789"):
        with pytest.raises(LauncherError, match="admin key"):
            server({}, admin_key=bad)


def test_image_listens_on_all_interfaces_on_purpose(tmp_path):
    ins = dockerfile_instructions()
    (entry,) = [json.loads(a) for i, a in ins if i == "ENTRYPOINT"]
    cmd = json.loads([a for i, a in ins if i == "CMD"][-1])
    assert "--host" in cmd and cmd[cmd.index("--host") + 1] == "0.0.0.0", cmd
    text = (DOCKER / "Dockerfile").read_text()
    before_cmd = text[:text.rindex("\nCMD ")].splitlines()[-8:]
    assert any(line.startswith("#") and "0.0.0.0" in line for line in before_cmd), \
        "say next to CMD why the image listens on every interface"
    assert "NIGHTDRAFT_ADMIN_KEY" not in " ".join(a for i, a in ins if i in ("ENV", "ARG")), \
        "an admin key baked into the image is everyone's key"
    server = serve_command(tmp_path, entry[2:] + cmd, env={})
    launched = server.command()
    assert "--http-address=0.0.0.0" in launched and "--model-control-mode=explicit" in launched
    assert restricted_flags(launched)["--http-restricted-api"][0] >= RESTRICTED


def port_host_ip(port) -> str | None:
    """The host address a compose port publishes on, as compose reads it without variables set."""
    if isinstance(port, dict):
        return port.get("host_ip")
    parts = default_of(str(port)).split(":")
    return ":".join(parts[:-2]) if len(parts) > 2 else None


def test_compose_publishes_on_loopback_by_default():
    services = load_compose()["services"]
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert port_host_ip(port) == "127.0.0.1", f"{name}: {port} publishes on every interface"
    # Prometheus has no authentication: loopback whatever NIGHTDRAFT_BIND says.
    assert all(str(p).startswith("127.0.0.1:") for p in services["prometheus"]["ports"])
    env = services["nightdraft"].get("environment", {})
    assert env.get("NIGHTDRAFT_ADMIN_KEY") == "${NIGHTDRAFT_ADMIN_KEY:-}", \
        "pass the admin key through from the environment, empty (closed) when unset"


def test_compose_grafana_needs_a_password_and_no_anonymous_access():
    env = load_compose()["services"]["grafana"]["environment"]
    password = env.get("GF_SECURITY_ADMIN_PASSWORD", "")
    assert re.fullmatch(r"\$\{GRAFANA_ADMIN_PASSWORD:?\?[^}]+\}", password), \
        f"compose must refuse to start without GRAFANA_ADMIN_PASSWORD, got {password!r}"
    assert str(env.get("GF_AUTH_ANONYMOUS_ENABLED", "false")).lower() == "false", env
    assert "GF_AUTH_ANONYMOUS_ORG_ROLE" not in env


def test_k8s_restricts_model_control_with_a_key_from_a_secret(tmp_path):
    dep = k8s_kind("Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    args = c["args"]
    assert args[args.index("--host") + 1] == "0.0.0.0", "in a pod the Service is the boundary"
    env = {e["name"]: e for e in c.get("env", [])}
    ref = env["NIGHTDRAFT_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] and ref["key"]
    assert ref.get("optional") is True, "without the Secret the pod must still start, APIs closed"
    assert not [n for n, d in k8s_docs() if d["kind"] == "Secret"], "never commit the key"
    docs = (REPO / "docs" / "deployment.md").read_text()
    assert f"kubectl create secret generic {ref['name']}" in docs and ref["key"] in docs

    (entry,) = [json.loads(a) for i, a in dockerfile_instructions() if i == "ENTRYPOINT"]
    for pod_env in ({"NIGHTDRAFT_ADMIN_KEY": KEY}, {}):   # with and without the Secret
        server = serve_command(tmp_path, entry[2:] + args, env=pod_env)
        launched = server.command()
        assert "--grpc-address=0.0.0.0" in launched
        flags = restricted_flags(launched)
        assert set(flags) == {"--http-restricted-api", "--grpc-restricted-protocol"}
        for apis, _, key in flags.values():
            assert apis >= RESTRICTED and key == server.admin_key
        assert (server.admin_key == KEY) == bool(pod_env)


# A real server: the cheap "preprocessing" model (a tokenizer, no engine), on the loopback default.

def non_loopback_ipv4() -> str | None:
    """This machine's address on its default route, if it has one (a UDP connect sends nothing)."""
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


@pytest.fixture(scope="module")
def admin_server(tmp_path_factory):
    from client.launcher import LauncherError, TritonServer, find_tritonserver, free_port
    try:
        find_tritonserver()
    except LauncherError as e:
        pytest.skip(f"no runnable tritonserver: {e}")
    engine_json = REPO / "model_repository" / "nightdraft" / "1" / "engine.json"
    engine = json.loads(engine_json.read_text())
    from backend.engine.paths import resolve_local
    for k in ("target", "drafter"):   # the copy lives elsewhere: absolute checkpoint paths
        engine[k] = str(resolve_local(k, engine[k], engine_json.parent))
    if not (Path(engine["target"]) / "tokenizer.json").is_file():
        pytest.skip(f"no tokenizer at {engine['target']} (make tiny-models)")
    tmp = tmp_path_factory.mktemp("triton-admin")
    repo = tmp / "model_repository"
    shutil.copytree(REPO / "model_repository" / "preprocessing", repo / "preprocessing",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "nightdraft" / "1").mkdir(parents=True)
    (repo / "nightdraft" / "1" / "engine.json").write_text(json.dumps(engine))
    # The launcher's defaults otherwise (host included); the key as deployments pass it.
    server = TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                          log_file=tmp / "tritonserver.log", models=["preprocessing"],
                          env={**os.environ, "NIGHTDRAFT_ADMIN_KEY": KEY}, exit_timeout_s=5)
    server.start()
    try:
        server.wait_ready(120)
    except LauncherError as e:
        server.stop(timeout_s=20)
        pytest.fail(f"tritonserver did not start: {e}", pytrace=False)
    yield server
    server.stop(timeout_s=30)


def http(server, method: str, path: str, headers: dict | None = None, body: bytes | None = None) -> int:
    import urllib.error
    import urllib.request
    req = urllib.request.Request(f"http://{server.http_url}{path}", data=body, method=method,
                                 headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.slow
def test_real_server_listens_on_loopback_only(admin_server):
    import socket
    ip = non_loopback_ipv4()
    if ip is None:
        pytest.skip("this machine has no non-loopback IPv4 address to try the ports on")
    for port in (admin_server.http_port, admin_server.grpc_port, admin_server.metrics_port):
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        with pytest.raises(OSError):
            socket.create_connection((ip, port), timeout=5).close()
            pytest.fail(f"port {port} answers on {ip}, not only on loopback")


@pytest.mark.slow
def test_real_server_admin_apis_need_the_key(admin_server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    unload = "/v2/repository/models/preprocessing/unload"
    ready = "/v2/models/preprocessing/ready"
    for headers in ({}, {ADMIN_HEADER: "wrong-key-0123456789"}):
        assert http(admin_server, "POST", unload, headers) == 403, headers
        for path in ("/v2/logging", "/v2/trace/setting", "/v2/systemsharedmemory/status"):
            assert http(admin_server, "GET", path, headers) == 403, (path, headers)
    assert http(admin_server, "GET", ready) == 200, "an unload without the key went through"

    # Serving stays open: inference needs no key.
    body = json.dumps({"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES",
                                   "data": ["hello"]}]}).encode()
    assert http(admin_server, "POST", "/v2/models/preprocessing/infer",
                {"Content-Type": "application/json"}, body) == 200

    client = grpcclient.InferenceServerClient(admin_server.grpc_url)
    try:
        with pytest.raises(InferenceServerException, match="restricted"):
            client.unload_model("preprocessing")
        index = client.get_model_repository_index(headers={GRPC_ADMIN_HEADER: KEY}, as_json=True)
        assert any(m["name"] == "preprocessing" for m in index.get("models", [])), index
        assert client.is_model_ready("preprocessing")
    finally:
        client.close()

    # With the key an operator administers the server.
    assert http(admin_server, "POST", unload, {ADMIN_HEADER: KEY}) == 200
    assert http(admin_server, "GET", ready) != 200
    assert http(admin_server, "POST", "/v2/repository/models/preprocessing/load", {ADMIN_HEADER: KEY}) == 200
    assert http(admin_server, "GET", ready) == 200


# ============================================================================== gpu_check.sh


def checkpoint_args(tmp_path: Path) -> list[str]:
    """The tiny pair when it is there; else stand-in folders (dry runs only read config.json)."""
    tiny_t, tiny_d = REPO / "models" / "tiny-target", REPO / "models" / "tiny-drafter"
    if (tiny_t / "config.json").is_file() and (tiny_d / "config.json").is_file():
        return []
    args = []
    for key in ("target", "drafter"):
        (tmp_path / key).mkdir(exist_ok=True)
        (tmp_path / key / "config.json").write_text("{}")
        args += [f"--{key}", str(tmp_path / key)]
    return args


def no_gpu_env() -> dict:
    """PATH without nvidia-smi, so the check is a dry run whatever machine runs the suite."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not (Path(p) / "nvidia-smi").exists())
    env["PYTHON"] = sys.executable
    return env


def test_gpu_check_dry_run_is_quick(tmp_path):
    t0 = time.monotonic()
    res = run(["bash", str(GPU_CHECK), "--dry-run", "--out", str(tmp_path / "out"), *checkpoint_args(tmp_path)],
              env=no_gpu_env(), timeout=60)
    elapsed = time.monotonic() - t0
    assert res.returncode == 0, res.stdout + res.stderr
    assert elapsed < 30, f"dry run took {elapsed:.1f}s"
    out = res.stdout
    assert "pytest -m gpu" in out
    assert re.search(r"bench offline --mode ar --device cuda", out)
    assert "--mode sd" in out, "the SD benchmark is missing"
    assert "dry run OK" in out
    assert not (tmp_path / "out").exists(), "a dry run must not write results"


def test_gpu_check_without_gpu_falls_back_to_dry_run(tmp_path):
    res = run(["bash", str(GPU_CHECK), "--skip-tests", "--out", str(tmp_path / "out"), *checkpoint_args(tmp_path)],
              env=no_gpu_env(), timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no NVIDIA GPU found" in res.stderr and "dry run OK" in res.stdout


@pytest.mark.parametrize("bad", [["--concurrency", "0"], ["--budget-s", "900"], ["--dtype", "fp8"],
                                 ["--target", "/nonexistent/checkpoint"], ["--no-such-flag"]])
def test_gpu_check_refuses_bad_input(bad, tmp_path):
    res = run(["bash", str(GPU_CHECK), "--dry-run", *checkpoint_args(tmp_path), *bad], env=no_gpu_env(), timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "gpu_check: error:" in res.stderr


FAKE_CLI = r'''
import json, sys
argv = sys.argv[1:]
if "--help" in argv:
    print("usage: nightdraft bench offline [-h] [--mode {ar,sd,psd,auto}] [--drafter-device DRAFTER_DEVICE]\n"
          "options:\n  --target T\n  --drafter D\n  --device DEV\n  --dtype DT\n  --mode {ar,sd,psd,auto}\n"
          "  --drafter-device DRAFTER_DEVICE\n  --num-prompts N\n  --max-tokens N\n  --concurrency N\n  --json OUT")
    sys.exit(0)
opt = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
assert opt["--device"] == "cuda", opt
speed = {"ar": 100.0, "sd": 180.0, "psd": 240.0, "auto": 250.0}[opt["--mode"]]
r = {"mode": opt["--mode"], "gamma": 0 if opt["--mode"] == "ar" else 4, "concurrency": int(opt["--concurrency"]),
     "tokens_per_s": speed, "acceptance_rate": 0.0 if opt["--mode"] == "ar" else 0.7,
     "mean_tokens_per_target_call": 1.0, "mean_step_s": 0.01, "outputs": [[1, 2]],
     "drafter_device": opt.get("--drafter-device")}
open(opt["--json"], "w").write(json.dumps(r))
print(f"{opt['--mode']}: {speed} tok/s")
'''


def test_gpu_check_run_with_a_stand_in_gpu(tmp_path):
    """The real (non-dry) path: GPU found, every offered mode and placement benchmarked, summary written."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nvidia-smi").write_text("#!/usr/bin/env bash\necho 'GPU 0: Stand-in (UUID: GPU-0)'\n"
                                       "echo 'GPU 1: Stand-in (UUID: GPU-1)'\n")
    (bindir / "python").write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        case "$*" in *torch.cuda*) echo 2; exit 0 ;; esac
        exec {sys.executable} "$@"
    """))
    (tmp_path / "fake_cli.py").write_text(FAKE_CLI)
    for f in bindir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "PYTHON": str(bindir / "python"),
           "NIGHTDRAFT": f"{sys.executable} {tmp_path / 'fake_cli.py'}"}
    out = tmp_path / "out"
    # --skip-tp: the tensor-parallel check runs the engine itself, which a stand-in GPU cannot.
    res = run(["bash", str(GPU_CHECK), "--skip-tests", "--skip-tp", "--out", str(out), "--concurrency", "1 8",
               *checkpoint_args(tmp_path)], env=env, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((out / "summary.json").read_text())
    runs = {r["run"] for r in summary}
    expected = {"ar", "sd-colocated", "sd-proc-cuda0", "sd-proc-cuda1", "psd-proc-cuda0", "psd-proc-cuda1",
                "auto-proc-cuda1"}
    assert runs == {f"c{c}-{n}" for c in (1, 8) for n in expected}, runs
    by = {r["run"]: r for r in summary}
    assert by["c8-psd-proc-cuda1"]["drafter_device"] == "cuda:1"
    assert by["c8-sd-colocated"]["drafter_device"] is None
    assert by["c8-psd-proc-cuda0"]["speedup_vs_ar"] == pytest.approx(2.4)
    assert "outputs" not in by["c1-ar"]
    assert (out / "env.txt").is_file()
    assert "all passed" in res.stdout


def test_gpu_marker_is_registered():
    text = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^\s*"gpu:', text, re.M), "register the gpu marker in [tool.pytest.ini_options]"


@pytest.mark.slow
def test_the_admin_key_help_says_what_the_process_list_shows(admin_server):
    """tritonserver takes the key only on its command line (no variable, no file): whoever can list
    its process reads it, whether it came from --admin-key or $NIGHTDRAFT_ADMIN_KEY. The flag's
    help and the deployment guide must say so, not that the variable keeps it out."""
    import argparse

    from client.launcher import add_serve_parser

    assert KEY.encode() in Path(f"/proc/{admin_server.proc.pid}/cmdline").read_bytes()
    assert KEY.encode() not in Path(f"/proc/{os.getpid()}/cmdline").read_bytes()
    parser = add_serve_parser(argparse.ArgumentParser().add_subparsers())
    (help_text,) = [a.help for a in parser._actions if "--admin-key" in a.option_strings]
    help_text = " ".join(help_text.split())
    assert "tritonserver gets the key on its command line" in help_text, help_text
    assert "keeps it out of this command's own command line" in help_text, help_text
    guide = " ".join((REPO / "docs" / "deployment.md").read_text().split())
    assert "`/proc/<pid>/cmdline`, whether it came from `--admin-key` or `$NIGHTDRAFT_ADMIN_KEY`" in guide
