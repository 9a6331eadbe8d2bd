"""`--kv-transfer-config`: prefill/decode disaggregation (vLLM's flag and field names).

    kv_producer   a prefill instance: serves the KV blocks of the prompts it computed (its
                  prefix cache) at kv_ip:kv_port to decode instances that ask for them
    kv_consumer   a decode instance: a request whose kv_transfer_params name a producer
                  (do_remote_prefill, remote_host, remote_port) fetches its prompt's blocks
                  from it into its own prefix cache before it is scheduled
    kv_both       both

One connector, "PagodaConnector" (distributed/kv_transfer.py): ZeroMQ between processes, on one
host or across hosts. kv_connector_extra_config: "timeout_s" (one fetch's wait, default 10) and
"retries" (further tries after a failed fetch, default 1); after them the request is computed
on the decode instance as if nothing had been sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagoda.flag_json import config_fields

KV_CONNECTORS = ("PagodaConnector",)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_KV_PORT = 14579  # vLLM's default kv_port
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_RETRIES = 1


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str
    kv_ip: str = "127.0.0.1"  # where a producer listens (and what it tells the proxy)
    kv_port: int = DEFAULT_KV_PORT
    engine_id: str | None = None  # reported in kv_transfer_params, for logs
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(
                f"kv_transfer_config: kv_connector must be one of {', '.join(KV_CONNECTORS)}; "
                f"got {self.kv_connector!r}"
            )
        if self.kv_role not in KV_ROLES:
            raise ValueError(
                f"kv_transfer_config: kv_role must be one of {', '.join(KV_ROLES)}; "
                f"got {self.kv_role!r}"
            )
        port = self.kv_port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"kv_transfer_config: kv_port must be a port number, got {port!r}")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict) or set(extra) - {"timeout_s", "retries"}:
            raise ValueError(
                "kv_transfer_config: kv_connector_extra_config takes timeout_s and retries; "
                f"got {extra!r}"
            )
        timeout, retries = self.timeout_s, self.retries
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"kv_transfer_config: timeout_s must be > 0, got {timeout!r}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"kv_transfer_config: retries must be an int >= 0, got {retries!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def timeout_s(self) -> float:
        return self.kv_connector_extra_config.get("timeout_s", DEFAULT_TIMEOUT_S)

    @property
    def retries(self) -> int:
        return self.kv_connector_extra_config.get("retries", DEFAULT_RETRIES)

    def remote_params(self) -> dict[str, Any]:
        """What a producer's response tells the proxy to hand the decode instance."""
        return {
            "do_remote_prefill": True,
            "remote_host": self.kv_ip,
            "remote_port": self.kv_port,
            "remote_engine_id": self.engine_id,
        }

    @classmethod
    def parse(
        cls, value: str | Mapping[str, Any] | KVTransferConfig | None
    ) -> KVTransferConfig | None:
        """From a JSON object string (the CLI flag), a dict, a config, or None."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        value = config_fields(value, "kv_transfer_config", cls)
        for name in ("kv_connector", "kv_role"):
            if name not in value:
                raise ValueError(f"kv_transfer_config needs {name}")
        return cls(**value)


def remote_prefill_source(params: Mapping[str, Any] | None) -> tuple[str, int] | None:
    """(host, port) of the producer a request's kv_transfer_params name, or None when they ask
    for no remote prefill. ValueError when they ask for one without a valid address."""
    if not params or not params.get("do_remote_prefill"):
        return None
    host, port = params.get("remote_host"), params.get("remote_port")
    if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int):
        raise ValueError(
            "kv_transfer_params with do_remote_prefill need remote_host (a string) and "
            f"remote_port (an int); got {dict(params)!r}"
        )
    return host, port
