"""GPU placement: one group of flags (-dev, -sm, -ts, -mg, -ot, -cmoe, --rpc...), spliced into
each command that loads models.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Annotated

import typer

from specli import config, rpc
from specli.cli.options.group import GPU, Group
from specli.errors import UsageError

# llama.cpp's -cmoe pattern (common.h LLM_FFN_EXPS_REGEX): every MoE expert tensor
FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


@dataclass(frozen=True)
class GpuFlags:
    """Where the target's and the draft's layers go, parsed from llama.cpp's flags. devices:
    None for all, () for none; the draft follows the target's devices unless -devd names
    its own. overrides: (tensor regex, buffer type) in the order llama.cpp applies them."""

    devices: tuple[str, ...] | None = None
    devices_draft: tuple[str, ...] | None = None
    split_mode: str = "layer"
    tensor_split: tuple[float, ...] = ()
    main_gpu: int = 0
    overrides: tuple[tuple[str, str], ...] = ()
    overrides_draft: tuple[tuple[str, str], ...] = ()
    rpc: tuple[str, ...] = ()  # llama.cpp RPC servers whose devices join the offload devices

    def apply(self, target: config.ModelParams,
              draft: config.ModelParams | None) -> tuple[config.ModelParams,
                                                         config.ModelParams | None]:
        target = replace(target, devices=self.devices, split_mode=self.split_mode,
                         tensor_split=self.tensor_split, main_gpu=self.main_gpu,
                         tensor_overrides=self.overrides, rpc=self.rpc)
        if draft is None:
            return target, None
        devices = self.devices_draft if self.devices_draft is not None else self.devices
        # as llama.cpp: a draft pinned to one device of its own needs no split across devices
        split = "layer" if self.devices_draft and len(self.devices_draft) == 1 \
            else self.split_mode
        return target, replace(draft, devices=devices, split_mode=split,
                               tensor_split=self.tensor_split, main_gpu=self.main_gpu,
                               tensor_overrides=self.overrides_draft, rpc=self.rpc)


def _list_devices(ctx: typer.Context, value: bool) -> None:
    if not value:
        return
    from specli.backend import connect_rpc, list_devices

    connect_rpc(rpc.parse(ctx.params.get("rpc_servers")))  # --rpc given before: listed too

    print("Available devices:")
    for d in list_devices():
        print(f"  {d.name}: {d.description} ({d.type}, {d.memory_total >> 20} MiB, "
              f"{d.memory_free >> 20} MiB free)")
    raise typer.Exit()


def _gpu_opt(*names: str, help: str, envvar: str | None = None, **kw):
    return typer.Option(*names, help=help, envvar=envvar, rich_help_panel=GPU,
                        show_default=False, **kw)


def _gpu_flags(
    device: Annotated[str | None, _gpu_opt(
        "-dev", "--device", metavar="DEV1,DEV2", envvar="LLAMA_ARG_DEVICE",
        help="Devices to offload the target to, comma-separated (none: do not offload). "
        "Default: all; see --list-devices.")] = None,
    device_draft: Annotated[str | None, _gpu_opt(
        "-devd", "--device-draft", "--spec-draft-device", metavar="DEV1,DEV2",
        help="Devices for the draft model. Default: as -dev.")] = None,
    rpc_servers: Annotated[str | None, _gpu_opt(
        "--rpc", metavar="HOST:PORT,...", envvar="LLAMA_ARG_RPC",
        help="RPC servers (specli rpc-server, or llama.cpp's) whose devices join the offload "
        "devices as RPC0, RPC1, ...: -ngl layers are split across them (-ts), the rest stay "
        "here. The draft follows unless -devd says otherwise (-devd none: keep it "
        "local).", is_eager=True)] = None,
    list_devices: Annotated[bool, _gpu_opt(
        "--list-devices", help="Print the devices this build of llama.cpp can use and exit.",
        callback=_list_devices, is_eager=True)] = False,
    split_mode: Annotated[str, _gpu_opt(
        "-sm", "--split-mode", metavar="none|layer|row|tensor", envvar="LLAMA_ARG_SPLIT_MODE",
        help="How to split the model across GPUs: none (one GPU, -mg), layer, row, or tensor "
        "(experimental). Default: layer.")] = "layer",
    tensor_split: Annotated[str | None, _gpu_opt(
        "-ts", "--tensor-split", metavar="N0,N1,...", envvar="LLAMA_ARG_TENSOR_SPLIT",
        help="Proportion of the model for each GPU, e.g. 3,1.")] = None,
    main_gpu: Annotated[int, _gpu_opt(
        "-mg", "--main-gpu", metavar="INDEX", envvar="LLAMA_ARG_MAIN_GPU",
        help="The GPU for the whole model with -sm none, or for intermediate results and KV "
        "with -sm row. Default: 0.")] = 0,
    override_tensor: Annotated[list[str] | None, _gpu_opt(
        "-ot", "--override-tensor", metavar="PATTERN=BUFT,...",
        envvar="LLAMA_ARG_OVERRIDE_TENSOR",
        help="Keep the target's tensors whose names match a regex in a buffer type (CPU, "
        "CUDA0, ...).")] = None,
    override_tensor_draft: Annotated[list[str] | None, _gpu_opt(
        "-otd", "--override-tensor-draft", "--spec-draft-override-tensor",
        metavar="PATTERN=BUFT,...", help="The same for the draft model.")] = None,
    cpu_moe: Annotated[bool, _gpu_opt(
        "-cmoe", "--cpu-moe", envvar="LLAMA_ARG_CPU_MOE",
        help="Keep all of the target's Mixture-of-Experts weights on the CPU.")] = False,
    n_cpu_moe: Annotated[int, _gpu_opt(
        "-ncmoe", "--n-cpu-moe", metavar="N", envvar="LLAMA_ARG_N_CPU_MOE",
        help="Keep the MoE weights of the target's first N layers on the CPU.")] = 0,
    cpu_moe_draft: Annotated[bool, _gpu_opt(
        "-cmoed", "--cpu-moe-draft", "--spec-draft-cpu-moe",
        envvar="LLAMA_ARG_SPEC_DRAFT_CPU_MOE",
        help="Keep all of the draft's MoE weights on the CPU.")] = False,
    n_cpu_moe_draft: Annotated[int, _gpu_opt(
        "-ncmoed", "--n-cpu-moe-draft", "--spec-draft-n-cpu-moe", "--spec-draft-ncmoe",
        metavar="N", envvar="LLAMA_ARG_SPEC_DRAFT_N_CPU_MOE",
        help="Keep the MoE weights of the draft's first N layers on the CPU.")] = 0,
) -> GpuFlags:
    """The GPU placement flags, checked; a device or buffer type that this build lacks is
    refused when the model loads, before any weights are read."""
    if split_mode not in ("none", "layer", "row", "tensor"):
        raise UsageError(f"-sm/--split-mode must be none, layer, row or tensor, got "
                         f"{split_mode!r}")
    for flag, n in (("-ncmoe/--n-cpu-moe", n_cpu_moe), ("-ncmoed/--n-cpu-moe-draft",
                                                          n_cpu_moe_draft)):
        if n < 0:
            raise UsageError(f"{flag} must be 0 or more, got {n}")
    return GpuFlags(
        devices=_devices(device, "-dev/--device"),
        devices_draft=_devices(device_draft, "-devd/--device-draft"),
        split_mode=split_mode, tensor_split=_tensor_split(tensor_split), main_gpu=main_gpu,
        overrides=_overrides(override_tensor, cpu_moe, n_cpu_moe, "-ot/--override-tensor"),
        overrides_draft=_overrides(override_tensor_draft, cpu_moe_draft, n_cpu_moe_draft,
                                   "-otd/--override-tensor-draft"),
        rpc=rpc.parse(rpc_servers))


def _devices(value: str | None, flag: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    names = [n.strip() for n in value.split(",")]
    if not value.strip() or any(not n for n in names):
        raise UsageError(f"{flag} takes device names, comma-separated, or none: {value!r}",
                         hint="see --list-devices")
    return () if names == ["none"] else tuple(names)


def _tensor_split(value: str | None) -> tuple[float, ...]:
    if value is None:
        return ()
    try:
        parts = tuple(float(v) for v in re.split(r"[,/]+", value.strip()))
    except ValueError:
        raise UsageError(f"-ts/--tensor-split takes proportions, comma-separated (3,1): "
                         f"{value!r}") from None
    if any(v < 0 or v != v or v == float("inf") for v in parts) or not any(parts):
        raise UsageError(f"-ts/--tensor-split proportions must be finite, 0 or more, and not "
                         f"all 0: {value!r}")
    return parts


def _overrides(values: list[str] | None, cpu_moe: bool, n_cpu_moe: int,
               flag: str) -> tuple[tuple[str, str], ...]:
    """-ot's PATTERN=BUFT pairs, then -cmoe's, then -ncmoe's (llama.cpp keeps the order of
    the command line; the first pattern that matches a tensor wins)."""
    out = []
    for item in (x for v in values or [] for x in v.split(",")):
        pattern, eq, buft = item.partition("=")
        if not eq or not pattern or not buft:
            raise UsageError(f"{flag} takes PATTERN=BUFFER_TYPE, comma-separated: {item!r}",
                             hint="e.g. -ot 'blk\\.[0-9]+\\.ffn_.*=CPU'")
        try:
            re.compile(pattern)
        except re.error as e:
            raise UsageError(f"{flag}: {pattern!r} is not a regular expression ({e})") from None
        out.append((pattern, buft))
    if cpu_moe:
        out.append((FFN_EXPS_REGEX, "CPU"))
    out += [(rf"blk\.{i}{FFN_EXPS_REGEX}", "CPU") for i in range(n_cpu_moe)]
    return tuple(out)


GPU_FLAGS = Group(_gpu_flags)
