"""The SGLang DFLASH worker tier as rendered: the seed's launch command, 8 GPUs, /dev/shm, model
cache, probes, the headless Service, the worker API key and the worker-less options."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.deploy.conftest import ROOT, Manifests, container, pod_spec

# The seed model card's launch command, with the current name of the draft-window flag
# (the card's --speculative-dflash-draft-window-size is a deprecated alias of it).
SEED_FLAGS: dict[str, str | None] = {
    "--model-path": "moonshotai/Kimi-K2.5",
    "--speculative-algorithm": "DFLASH",
    "--speculative-draft-model-path": "z-lab/Kimi-K2.5-DFlash",
    "--speculative-num-draft-tokens": "8",
    "--tp-size": "8",
    "--attention-backend": "trtllm_mla",
    "--speculative-draft-attention-backend": "fa4",
    "--mem-fraction-static": "0.9",
    "--speculative-draft-window-size": "4096",
    "--trust-remote-code": None,
}
# What a gateway deployment adds (SGLANG_PROTOCOL.md).
DEPLOYMENT_FLAGS: dict[str, str | None] = {
    "--enable-metrics": None,
    "--host": "0.0.0.0",
    "--port": "30000",
    "--reasoning-parser": "kimi_k2",
    "--tool-call-parser": "kimi_k2",
}
SEED_ALIASES = {"--speculative-dflash-draft-window-size": "--speculative-draft-window-size"}
SEED_FILES = sorted((ROOT.parent / "shared" / "seeds").glob("*.txt"))


def parse_flags(args: list[str]) -> dict[str, str | None]:
    """argv -> {flag: value or None for a switch}; a flag may appear once."""
    flags: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        flag = args[i]
        assert flag.startswith("--"), f"stray argument {flag!r}"
        assert flag not in flags, f"{flag} given twice"
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            flags[flag] = args[i + 1]
            i += 2
        else:
            flags[flag] = None
            i += 1
    return flags


def worker_flags(m: Manifests) -> dict[str, str | None]:
    c = container(m.workers, "sglang")
    assert c["command"] == ["python3", "-m", "sglang.launch_server"]
    return parse_flags(c["args"])


def test_worker_command_has_every_seed_flag_with_its_value(
    render: Callable[..., Manifests],
) -> None:
    flags = worker_flags(render())
    for flag, value in {**SEED_FLAGS, **DEPLOYMENT_FLAGS}.items():
        assert flag in flags, f"{flag} missing"
        assert flags[flag] == value, f"{flag}={flags[flag]!r}, want {value!r}"
    assert set(flags) == set(SEED_FLAGS) | set(DEPLOYMENT_FLAGS)


@pytest.mark.skipif(not SEED_FILES, reason="shared/seeds not beside the repository")
def test_seed_launch_command_is_the_one_the_tests_check() -> None:
    """Cross-check SEED_FLAGS against the model card itself (shared/seeds/)."""
    text = SEED_FILES[0].read_text()
    command = re.search(r"python -m sglang\.launch_server(.*?)(?:\n\s*\n)", text, re.S)
    assert command, "launch command not found in the seed"
    args = command.group(1).replace("\\\n", " ").split()
    seed = {SEED_ALIASES.get(k, k): v for k, v in parse_flags(args).items()}
    assert seed == SEED_FLAGS


def test_worker_gets_exactly_eight_gpus(render: Callable[..., Manifests]) -> None:
    resources = container(render().workers, "sglang")["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 8
    assert resources["requests"]["nvidia.com/gpu"] == 8
    assert "cpu" not in resources["limits"]  # no CPU throttling of SGLang's processes
    assert "memory" in resources["limits"]


def test_dev_shm_is_a_memory_emptydir(render: Callable[..., Manifests]) -> None:
    sts = render().workers
    [mount] = [m for m in container(sts, "sglang")["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    [volume] = [v for v in pod_spec(sts)["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    assert volume["emptyDir"]["sizeLimit"] == "64Gi"


def test_probes_hit_health_on_the_sglang_port(render: Callable[..., Manifests]) -> None:
    c = container(render().workers, "sglang")
    [port] = c["ports"]
    assert port == {"name": "http", "containerPort": 30000, "protocol": "TCP"}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    startup = c["startupProbe"]
    # Tens of minutes for download + load of the weights before the pod is restarted.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60
    # /health runs a generation and answers within ~20 s on a busy worker.
    assert c["readinessProbe"]["timeoutSeconds"] > 20
    assert c["livenessProbe"]["timeoutSeconds"] > 20


def test_headless_service_selects_exactly_the_worker_pods(render: Callable[..., Manifests]) -> None:
    m = render()
    sts = m.workers
    svc = m.one("Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is False
    assert svc["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"] == [
        {"name": "http", "port": 30000, "targetPort": "http", "protocol": "TCP"}
    ]


def test_model_cache_is_a_volume_claim_per_worker_by_default(
    render: Callable[..., Manifests],
) -> None:
    sts = render().workers
    [claim] = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "model-cache"
    c = container(sts, "sglang")
    assert {"name": "model-cache", "mountPath": "/models"} in c["volumeMounts"]
    assert {"name": "HF_HOME", "value": "/models/huggingface"} in c["env"]


@pytest.mark.parametrize(
    ("value_set", "source"),
    [("four-workers-custom", "persistentVolumeClaim"), ("ingress-hpa-netpol", "hostPath")],
)
def test_model_cache_alternatives(
    render: Callable[..., Manifests], value_set: str, source: str
) -> None:
    sts = render(value_set).workers
    assert "volumeClaimTemplates" not in sts["spec"]
    [volume] = [v for v in pod_spec(sts)["volumes"] if v["name"] == "model-cache"]
    assert source in volume


def test_four_workers_with_custom_flags(render: Callable[..., Manifests]) -> None:
    m = render("four-workers-custom")
    sts = m.workers
    assert sts["spec"]["replicas"] == 4
    c = container(sts, "sglang")
    assert c["image"].startswith("lmsysorg/sglang@sha256:")
    flags = worker_flags(m)
    assert flags["--speculative-draft-window-size"] == "8192"
    assert flags["--served-model-name"] == "kimi-k2.5"
    assert flags["--max-running-requests"] == "48"
    assert flags["--context-length"] == "131072"
    assert "--enable-cache-report" in flags
    # The workers' API key: the flag takes the value of a Secret-backed variable.
    assert flags["--api-key"] == "$(SGLANG_WORKER_API_KEY)"
    [env] = [e for e in c["env"] if e["name"] == "SGLANG_WORKER_API_KEY"]
    assert env["valueFrom"]["secretKeyRef"] == {
        "name": "sglang-worker-key",
        "key": "worker-api-key",
    }
    # The Hugging Face token is a file, not a variable.
    assert {"name": "HF_TOKEN_PATH", "value": "/var/run/secrets/huggingface/token"} in c["env"]
    assert not [e for e in c["env"] if e["name"] == "HF_TOKEN"]
    assert pod_spec(sts)["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-B200"}
    for flag, value in SEED_FLAGS.items():
        if flag != "--speculative-draft-window-size":
            assert flags[flag] == value


def test_gpu_nodes_tolerated_and_pods_lean(render: Callable[..., Manifests]) -> None:
    spec = pod_spec(render().workers)
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False
    assert spec["terminationGracePeriodSeconds"] > 0
    sec = container(render().workers, "sglang")["securityContext"]
    assert sec["allowPrivilegeEscalation"] is False
    assert sec["capabilities"]["drop"] == ["ALL"]


def test_draft_window_can_be_omitted(render: Callable[..., Manifests]) -> None:
    flags = worker_flags(render("default", "--set", "workers.sglang.draftWindowSize=0"))
    assert "--speculative-draft-window-size" not in flags


def test_external_workers_only_renders_no_worker_tier(render: Callable[..., Manifests]) -> None:
    m = render("external-workers")
    assert m.all("StatefulSet") == []
    assert [s["metadata"]["name"] for s in m.all("Service")] == ["ci-dflash-gateway"]
    assert m.all("Role") == []  # static list: no API access needed
    assert m.gateway["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    settings = m.gateway_settings()
    assert settings["worker_urls"] == ["http://10.0.0.5:30000", "http://10.0.0.6:30000"]
    assert settings["discovery"] == {"mode": "static"}


def test_worker_tier_disabled_with_own_discovery(render: Callable[..., Manifests]) -> None:
    m = render(
        "default",
        "--set", "workers.enabled=false",
        "--set", "gateway.settings.discovery.mode=dns",
        "--set", "gateway.settings.discovery.dns_name=sglang.gpu.svc.cluster.local",
    )  # fmt: skip
    assert m.all("StatefulSet") == []
    assert m.gateway_settings()["discovery"]["dns_name"] == "sglang.gpu.svc.cluster.local"


def test_worker_doc_command_matches_the_chart(render: Callable[..., Manifests]) -> None:
    """docker/worker.md's command is the chart's worker command (one launch command)."""
    text = (ROOT / "docker" / "worker.md").read_text()
    block = re.search(r"```bash\n(docker run.*?)```", text, re.S)
    assert block, "docker run block missing in docker/worker.md"
    words = block.group(1).replace("\\\n", " ").split()
    start = words.index("sglang.launch_server") + 1
    assert words[start - 2 : start] == ["-m", "sglang.launch_server"]
    assert parse_flags(words[start:]) == worker_flags(render())


def test_worker_image_tag_in_values_matches_worker_doc(render: Callable[..., Manifests]) -> None:
    image = container(render().workers, "sglang")["image"]
    assert image.startswith("lmsysorg/sglang:v")
    assert image in Path(ROOT / "docker" / "worker.md").read_text()


def test_keda_scales_the_workers_on_fleet_saturation(render: Callable[..., Manifests]) -> None:
    from prometheus_client import CollectorRegistry

    from app.metrics import Families

    m = render("keda-workers")
    scaled = m.one("ScaledObject")
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": m.workers["metadata"]["name"],
    }
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 6)
    assert spec["cooldownPeriod"] == 2400
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 2400
    [trigger] = spec["triggers"]
    assert (trigger["type"], trigger["metricType"]) == ("prometheus", "Value")
    assert trigger["metadata"] == {
        "serverAddress": "http://prometheus-operated.monitoring.svc:9090",
        "query": 'max(dflash_gateway_fleet_saturation{namespace="dflash"})',
        "threshold": "0.75",
    }
    # The query names a gauge the gateway exports.
    families = Families(CollectorRegistry())
    assert families.fleet_saturation._name == "dflash_gateway_fleet_saturation"
    # KEDA owns the replica count; off by default, where the StatefulSet keeps it.
    assert "replicas" not in m.workers["spec"]
    assert render().all("ScaledObject") == []
    assert render().workers["spec"]["replicas"] == 2
    custom = render("keda-workers", "--set", "workers.autoscaling.keda.query=vector(1)")
    assert custom.one("ScaledObject")["spec"]["triggers"][0]["metadata"]["query"] == "vector(1)"


# The model card's vLLM path (vLLM PR 39930): vllm serve with the DFlash drafter as its
# speculative model, tensor parallel over the node's 8 GPUs; what a gateway deployment adds.
VLLM_FLAGS: dict[str, str | None] = {
    "--speculative-config": (
        '{"method":"dflash","model":"z-lab/Kimi-K2.5-DFlash","num_speculative_tokens":7}'
    ),
    "--tensor-parallel-size": "8",
    "--max-num-seqs": "64",
    "--gpu-memory-utilization": "0.9",
    "--trust-remote-code": None,
    "--reasoning-parser": "kimi_k2",
    "--tool-call-parser": "kimi_k2",
    "--enable-auto-tool-choice": None,
    "--host": "0.0.0.0",
    "--port": "30000",
    "--api-key": "$(SGLANG_WORKER_API_KEY)",
}


def test_vllm_engine_renders_a_vllm_dflash_worker_on_eight_gpus(
    render: Callable[..., Manifests],
) -> None:
    m = render("vllm-workers")
    c = container(m.workers, "vllm")
    assert c["image"] == "vllm/vllm-openai:nightly"
    assert c["command"] == ["vllm", "serve"]
    assert c["args"][0] == "moonshotai/Kimi-K2.5"
    assert parse_flags(c["args"][1:]) == VLLM_FLAGS
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 8
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    # The gateway is told the engine, and admits up to the workers' --max-num-seqs.
    assert m.gateway_settings()["workers"] == {"engine": "vllm", "vllm_max_num_seqs": 64}
    # No SGLang container, and the default render keeps SGLang with no engine setting.
    assert [x["name"] for x in pod_spec(m.workers)["containers"]] == ["vllm"]
    assert "workers" not in render().gateway_settings()
