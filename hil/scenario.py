"""HIL scenario files (``hil/scenarios/*.toml``), validated like node configs.

A scenario names the nodes (simulated: a flight over the shared replayed scene; real: the address of a
board), the scene and how many ground-truth targets it holds, the network, a timeline of faults and the
pass criteria. Unknown keys and bad values are one line naming the key path (``faults[2].node: ...``);
the command exits 2.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from edgerun.config import _message
from edgerun.errors import ConfigError
from edgerun.ota.store import STEPS
from edgerun.testing.control import ACCELERATOR_KEY
from edgerun.tomlfile import load_toml
from swarm.geo import DEFAULT_ANCHOR

PositiveFloat = Annotated[float, msgspec.Meta(gt=0.0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]
Percent = Annotated[float, msgspec.Meta(ge=0.0, le=100.0)]
Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]

FaultKind = Literal[
    "accelerator_exception",
    "accelerator_hang",
    "partition",
    "broker_restart",
    "kill",
    "ota_release",
    "ota_power_cut",
    "clock_skew",
    "camera_loss",
]
# Faults that act on one node, and those of them a real board (driven over MQTT/HTTP only) cannot take.
NODE_FAULTS = frozenset(
    {"accelerator_exception", "accelerator_hang", "kill", "ota_power_cut", "clock_skew", "camera_loss"}
)
# Faults that last ``duration_s`` and are then undone (heal, broker back, restart, clear, camera back).
TIMED_FAULTS = frozenset(
    {"accelerator_exception", "accelerator_hang", "partition", "broker_restart", "kill", "camera_loss", "clock_skew"}
)


class ScenarioError(ConfigError):
    """The scenario file is invalid; the message names the key path (exit 2)."""


class Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base for scenario sections: unknown keys are errors."""


class SceneSpec(Section):
    seed: int = 1  # the replayed scene and flight path (edgerun.sources.replay)
    targets: Annotated[int, msgspec.Meta(ge=0)] = 0  # ground-truth targets the fleet's flights cover; 0: not said
    fps: PositiveFloat = 5.0  # replay rate of every simulated node
    speed_mps: PositiveFloat = 1.5  # flight speed along the shared path
    width: Annotated[int, msgspec.Meta(ge=64)] = 640
    height: Annotated[int, msgspec.Meta(ge=64)] = 480
    # Where the scene lies on Earth ([lat, lon] and its ground's AMSL height): the fleet objects' lat/lon.
    origin: list[float] = msgspec.field(default_factory=lambda: list(DEFAULT_ANCHOR[:2]))
    ground_alt_m: float = DEFAULT_ANCHOR[2]


class SwarmSpec(Section):
    radius_m: PositiveFloat = 2.0  # the demo scene's faces lie 3-6 m apart (edgerun.demo_swarm.DEMO_RADIUS_M)
    hold_s: NonNegFloat | None = None  # swarm.hold_s; None: the node's default
    window_s: PositiveFloat | None = None  # how long the swarm remembers a reported object; None: the node's default
    timing: dict[str, int | float] = msgspec.field(default_factory=dict)  # [swarm.timing] overrides for every node


class NetworkSpec(Section):
    loss_percent: Percent = 0.0  # share of packets every node drops on receive (nftables, or netem)


class BrokerSpec(Section):
    address: str = ""  # host:port of an existing broker (real rigs); empty: a private mosquitto the run starts


class OffloadSpec(Section):
    """The node's [offload] section (edgerun.config.OffloadConfig, docs/offload.md); left out: the node's defaults."""

    mode: Literal["never", "auto", "always"] = "never"
    serve: bool = False
    codec: Literal["jpeg", "zstd"] | None = None
    window: Annotated[int, msgspec.Meta(ge=1)] | None = None
    deadline_ms: PositiveFloat | None = None

    @property
    def used(self) -> bool:
        return self.mode != "never" or self.serve


class NodeSpec(Section):
    id: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,40}$")]
    # Simulated: a real `edgerun run` process flying the scene.
    engines: list[str] = msgspec.field(default_factory=lambda: ["tflite"])
    model: str = ""  # bundle path; empty: the demo BlazeFace bundle
    path_offset_m: float | None = None  # start along the shared flight path; None: edgerun.demo_swarm's layout
    east_offset_m: float | None = None
    hang_deadline_ms: Annotated[int, msgspec.Meta(ge=0)] = 500
    loss_percent: Percent | None = None  # this node's own loss; None: network.loss_percent
    offload: OffloadSpec = msgspec.field(default_factory=OffloadSpec)  # borrowing or lending an engine (#25)
    # Its "hilcpu" engine's time per call at least (a weaker board's CPU: a test double, edgerun.testing.control).
    cpu_delay_ms: Annotated[float, msgspec.Meta(ge=0.0, le=60_000.0)] = 0.0
    # Real board: observed over MQTT (its node id) and HTTP (this base URL, /metrics and /healthz) only.
    address: str = ""

    @property
    def real(self) -> bool:
        return bool(self.address)


class FaultSpec(Section):
    at_s: NonNegFloat
    kind: FaultKind
    node: str = ""  # node faults: which node
    duration_s: NonNegFloat = 0.0  # timed faults: undone after this long (kill: restarted)
    groups: list[list[str]] = msgspec.field(default_factory=list)  # partition: the sides
    step: str = ""  # ota_power_cut: the journal step the node dies at
    version: Annotated[int, msgspec.Meta(ge=2)] = 2  # ota_release: the version published
    skew_s: float = 0.0  # clock_skew: added to the node's wall clock


class CriteriaSpec(Section):
    """Pass criteria; a criterion left out is not checked."""

    min_object_recall: Fraction | None = None
    max_duplicate_ratio: Fraction | None = None  # duplicate fleet reports / ground-truth objects found
    # Faces in view that a detection matched but no fleet object reported (a node killed before it could decide
    # is not counted against dedup): at-least-once reporting says 0.
    max_dedup_losses: Annotated[int, msgspec.Meta(ge=0)] | None = None
    max_latency_p50_ms: PositiveFloat | None = None  # capture (node's wall clock) to the observer's receive
    max_latency_p99_ms: PositiveFloat | None = None
    max_failover_s: PositiveFloat | None = None  # accelerator fault injected -> first batch from the fallback
    # Per accelerator fault: batches a neighbour inferred for the faulted node while the fault lasted (#25).
    min_offloaded_after_failover: Annotated[int, msgspec.Meta(ge=0)] | None = None
    max_ota_convergence_s: PositiveFloat | None = None  # release published -> every node serving it
    max_outage_s: PositiveFloat | None = None  # longest silence of a node beyond what the faults explain
    max_unexpected_exits: Annotated[int, msgspec.Meta(ge=0)] | None = 0
    max_unaccounted_loss: Annotated[int, msgspec.Meta(ge=0)] | None = 0  # batches lost beyond the nodes' drop counters
    min_batches_per_node: Annotated[int, msgspec.Meta(ge=0)] = 1


class Scenario(Section, kw_only=True):
    name: str
    duration_s: PositiveFloat
    description: str = ""
    scene: SceneSpec = msgspec.field(default_factory=SceneSpec)
    swarm: SwarmSpec = msgspec.field(default_factory=SwarmSpec)
    network: NetworkSpec = msgspec.field(default_factory=NetworkSpec)
    broker: BrokerSpec = msgspec.field(default_factory=BrokerSpec)
    nodes: list[NodeSpec]
    faults: list[FaultSpec] = msgspec.field(default_factory=list)
    criteria: CriteriaSpec = msgspec.field(default_factory=CriteriaSpec)

    def node(self, node_id: str) -> NodeSpec:
        return next(n for n in self.nodes if n.id == node_id)

    @property
    def simulated(self) -> list[NodeSpec]:
        return [n for n in self.nodes if not n.real]


def parse_scenario(data: dict, *, source: str = "scenario") -> Scenario:
    """Validate a parsed TOML table into a Scenario, or raise ScenarioError naming the key."""
    try:
        scenario = msgspec.convert(data, Scenario)
    except msgspec.ValidationError as err:
        if str(err).startswith("Invalid enum value"):
            raise ScenarioError(f"{source}: {_enum_message(err, data)}") from None
        raise ScenarioError(f"{source}: {_message(err, data, Scenario)}") from None
    problem = _semantic_problem(scenario)
    if problem:
        raise ScenarioError(f"{source}: {problem}")
    return scenario


def _enum_message(err: msgspec.ValidationError, data: dict) -> str:
    """``faults[2].kind: expected one of ...``: the Literal's values, found through list items too."""
    path = str(err).split("`$", 1)[1].rstrip("`") if "`$" in str(err) else ""
    tp: Any = Scenario
    value: Any = data
    for name, index in re.findall(r"\.([^.\[]+)|\[(\d+)\]", path):
        if index:
            tp = typing.get_args(tp)[0]
            value = value[int(index)] if isinstance(value, list) else None
            continue
        tp = typing.get_type_hints(tp, include_extras=True)[name]
        while typing.get_origin(tp) is Annotated:
            tp = typing.get_args(tp)[0]
        value = value.get(name) if isinstance(value, dict) else None
    choices = ", ".join(repr(v) for v in typing.get_args(tp))
    return f"{path.lstrip('.')}: expected one of {choices}, got {value!r}"


def load_scenario(path: str | Path) -> Scenario:
    """Read a scenario file; a bare name (``smoke``) is looked up in ``hil/scenarios/``."""
    path = Path(path)
    if not path.suffix and not path.exists():
        path = Path(__file__).resolve().parent / "scenarios" / f"{path}.toml"
    return parse_scenario(load_toml(path, ScenarioError, "scenario file"), source=str(path))


def _semantic_problem(s: Scenario) -> str:
    """Rules that span fields: the first one broken, as ``key.path: what is wrong``, or ''."""
    ids = [n.id for n in s.nodes]
    if not ids:
        return "nodes: expected at least one node"
    for i, node in enumerate(s.nodes):
        if ids.index(node.id) != i:
            return f"nodes[{i}].id: {node.id!r} is used twice"
        if not node.real and not node.engines:
            return f"nodes[{i}].engines: expected at least one engine"
        if node.real and not node.address.startswith(("http://", "https://")):
            return f"nodes[{i}].address: expected an http:// URL of the board's HTTP service, got {node.address!r}"
    if any(n.real for n in s.nodes) and not s.broker.address:
        return "broker.address: real boards need the broker they publish to (host:port)"
    origin = s.scene.origin
    if not (len(origin) == 2 and -90.0 <= origin[0] <= 90.0 and -180.0 <= origin[1] <= 180.0):
        return f"scene.origin: expected [latitude, longitude] in degrees, got {origin}"
    release_at = [f.at_s for f in s.faults if f.kind == "ota_release"]
    for i, fault in enumerate(s.faults):
        key = f"faults[{i}]"
        if fault.at_s >= s.duration_s:
            return f"{key}.at_s: {fault.at_s:g} is not within the scenario's {s.duration_s:g} s"
        if fault.kind in NODE_FAULTS:
            if fault.node not in ids:
                return f"{key}.node: expected one of {', '.join(map(repr, ids))}, got {fault.node!r}"
            node = s.node(fault.node)
            if fault.kind.startswith("accelerator") and not node.real and ACCELERATOR_KEY not in node.engines:
                return f"{key}.node: {fault.node!r} has no {ACCELERATOR_KEY!r} in its engines to fault"
        elif fault.node:
            return f"{key}.node: a {fault.kind} fault acts on no single node"
        if fault.kind in TIMED_FAULTS and fault.kind != "clock_skew" and fault.duration_s <= 0:
            return f"{key}.duration_s: a {fault.kind} fault needs a duration > 0"
        if fault.kind == "partition":
            flat = [name for group in fault.groups for name in group]
            if len(fault.groups) < 2 or any(not group for group in fault.groups):
                return f"{key}.groups: expected two or more non-empty groups of node ids"
            unknown = [name for name in flat if name not in ids]
            if unknown:
                return f"{key}.groups: unknown node {unknown[0]!r}"
            if len(set(flat)) != len(flat):
                return f"{key}.groups: a node is in two groups"
        elif fault.groups:
            return f"{key}.groups: only a partition has groups"
        if fault.kind == "ota_power_cut":
            if fault.step not in STEPS:
                return f"{key}.step: expected one of {', '.join(map(repr, STEPS))}, got {fault.step!r}"
            if not any(at >= fault.at_s for at in release_at):
                return f"{key}.at_s: a power cut at an OTA step must be armed before an ota_release fault"
        elif fault.step:
            return f"{key}.step: only an ota_power_cut has a step"
        if fault.kind == "clock_skew" and fault.skew_s == 0:
            return f"{key}.skew_s: a clock_skew fault needs a skew other than 0"
    return ""
