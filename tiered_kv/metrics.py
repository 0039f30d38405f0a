"""Cache metrics: tokens hit per tier and missed, transfers per direction, evictions per tier,
storage errors; as a flat dict and as Prometheus text exposition."""

from __future__ import annotations

from dataclasses import asdict, dataclass

TIERS = ("device", "host", "storage")


@dataclass
class RequestHits:
    """Where one request's prompt came from, in tokens."""

    prompt_tokens: int = 0
    device: int = 0
    host: int = 0
    storage: int = 0
    missed: int = 0  # computed by the model (includes the last token, which always is)


@dataclass
class HitCounters:
    requests: int = 0
    prompt_tokens: int = 0
    device: int = 0
    host: int = 0
    storage: int = 0
    missed: int = 0

    def add(self, r: RequestHits) -> None:
        self.requests += 1
        self.prompt_tokens += r.prompt_tokens
        self.device += r.device
        self.host += r.host
        self.storage += r.storage
        self.missed += r.missed


def prometheus_text(stats: dict, prefix: str = "tiered_kv") -> str:
    """Prometheus text format (0.0.4) of the numeric leaves of ``stats`` (nested dicts are
    flattened into labels: ``{"transfer": {"host_to_device": {"bytes": 1}}}`` becomes
    ``tiered_kv_transfer_bytes{direction="host_to_device"} 1``)."""
    families: dict[str, list[str]] = {}

    def emit(name: str, labels: dict[str, str], value: float) -> None:
        metric = f"{prefix}_{name}"
        label = ",".join(f'{k}="{v}"' for k, v in labels.items())
        families.setdefault(metric, []).append(
            f"{metric}{{{label}}} {value}" if label else f"{metric} {value}"
        )

    label_of = {"hits": "tier", "transfer": "direction", "evictions": "tier"}
    for group, body in stats.items():
        if isinstance(body, dict) and group in label_of:
            for sub, values in body.items():
                if isinstance(values, dict):
                    for k, v in values.items():
                        if isinstance(v, (int, float)) and not isinstance(v, bool):
                            emit(f"{group}_{k}", {label_of[group]: sub}, v)
                elif isinstance(values, (int, float)):
                    emit(f"{group}_tokens_total", {label_of[group]: sub}, values)
        elif isinstance(body, dict):
            for k, v in body.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    emit(f"{group}_{k}", {}, v)
        elif isinstance(body, (int, float)) and not isinstance(body, bool):
            emit(group, {}, body)
    lines: list[str] = []
    for metric, samples in families.items():
        counter = metric.endswith(("_total", "_bytes", "_seconds", "_ops", "_requests"))
        lines.append(f"# TYPE {metric} {'counter' if counter else 'gauge'}")
        lines.extend(samples)
    return "\n".join(lines) + "\n"


def as_dict(obj) -> dict:
    return asdict(obj)
