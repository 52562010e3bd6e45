"""runner.training.accelerator and the accelerate launch configs, on CPU, with simulated H200 / MI300X identities."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from runner.config.schema import HardwareRecipe, ModelRecipe, OptimRecipe
from runner.errors import RunnerError
from runner.training import accelerator as backends

ROOT = Path(__file__).resolve().parents[2]
ACCEL_DIR = ROOT / "recipes" / "hardware" / "accelerate"
H200 = "cuda:NVIDIA H200"
MI300X = "rocm:AMD Instinct MI300X:gfx942"

H200_HW = HardwareRecipe(accelerator="cuda", device_name="H200 SXM", precision="bf16", tf32=True, pin_memory=True)
MI300X_HW = HardwareRecipe(accelerator="rocm", device_name="MI300X", precision="bf16", tf32=False, pin_memory=True)
CPU_HW = HardwareRecipe(accelerator="cpu", device_name="cpu", precision="fp32", tf32=True, pin_memory=True)
MODEL = ModelRecipe(attn_implementation="sdpa", compile=False)
FUSED = OptimRecipe(fused=True)


@pytest.fixture(autouse=True)
def _restore_torch_flags(monkeypatch):
    monkeypatch.delenv("RUNNER_SIMULATE_DEVICE", raising=False)
    yield
    backends.restore_default_settings()


# --- device identity -------------------------------------------------------------------------


def test_simulated_identities_carry_the_facts_attention_checks_need():
    h200 = backends.device_identity(H200)
    assert (h200.accelerator, h200.canonical, backends.cuda_capability(h200)) == ("cuda", "H200 SXM", (9, 0))
    mi = backends.device_identity(MI300X)
    assert (mi.accelerator, mi.canonical, mi.arch) == ("rocm", "MI300X", "gfx942")
    assert backends.torch_device_type(mi) == "cuda"  # HIP devices are torch "cuda" devices
    assert backends.cuda_capability(backends.device_identity("cuda:Tesla V100:sm_70")) == (7, 0)


def test_env_var_simulation_is_what_detection_returns(monkeypatch):
    monkeypatch.setenv("RUNNER_SIMULATE_DEVICE", MI300X)
    record = backends.apply_runtime(MI300X_HW, MODEL).record
    assert record["device_canonical"] == "MI300X" and record["device_simulated"] is True


# --- attention backends ----------------------------------------------------------------------


@pytest.mark.parametrize("device,hint", [(H200, "Dao-AILab/flash-attention"), (MI300X, "ROCm/flash-attention")])
def test_missing_flash_attention_3_is_one_line_naming_the_key_and_the_install(device, hint):
    with pytest.raises(RunnerError) as err:
        backends.check_attention_backend("flash_attention_3", device, file="experiments/1p3b.yaml")
    message = str(err.value)
    assert message.startswith("experiments/1p3b.yaml: model.attn_implementation: ")
    assert "flash_attn_interface" in message and hint in message and "\n" not in message


def test_missing_flash_attention_2_names_its_package():
    with pytest.raises(RunnerError, match=r"model\.attn_implementation: .*flash_attn package is not installed"):
        backends.check_attention_backend("flash_attention_2", H200)


def test_installed_flash_attention_3_is_accepted_on_hopper_only(tmp_path, monkeypatch):
    (tmp_path / "flash_attn_interface").mkdir()
    (tmp_path / "flash_attn_interface" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    choice = backends.check_attention_backend("flash_attention_3", H200)
    assert (choice.attn_implementation, choice.package) == ("flash_attention_3", "flash_attn_interface")
    with pytest.raises(RunnerError, match="Hopper"):
        backends.check_attention_backend("flash_attention_3", "cuda:NVIDIA B200")
    with pytest.raises(RunnerError, match="needs a CUDA or ROCm GPU"):
        backends.check_attention_backend("flash_attention_3", "cpu")


def test_unknown_backend_and_kernel_are_refused():
    with pytest.raises(RunnerError, match="unknown attention backend"):
        backends.check_attention_backend("flex", "cpu")
    with pytest.raises(RunnerError, match="model.sdpa_kernel"):
        backends.check_attention_backend("sdpa", "cpu", sdpa_kernel="fastest")
    with pytest.raises(RunnerError, match="only applies to attn_implementation sdpa"):
        backends.check_attention_backend("eager", "cpu", sdpa_kernel="flash")


def test_sdpa_kernels_by_device():
    with pytest.raises(RunnerError, match="efficient"):
        backends.check_attention_backend("sdpa", "cpu", sdpa_kernel="efficient")
    with pytest.raises(RunnerError, match="CUDA-only"):
        backends.check_attention_backend("sdpa", MI300X, sdpa_kernel="cudnn")
    assert backends.check_attention_backend("sdpa", MI300X, sdpa_kernel="efficient").sdpa_kernel == "efficient"
    assert backends.check_attention_backend("sdpa", "cpu", sdpa_kernel="flash").sdpa_kernel == "flash"


def test_sdpa_context_pins_the_kernel_instead_of_falling_back():
    q = torch.randn(1, 2, 8, 16)
    with backends.check_attention_backend("sdpa", "cpu", sdpa_kernel="math").context():
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    # A kernel the CPU lacks fails loudly inside the pin: the pin is real, not advisory.
    pinned = backends.AttentionBackend("sdpa", "efficient", "cpu")
    with pytest.raises(RuntimeError), pinned.context():
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)


# --- runtime settings ------------------------------------------------------------------------


def _matmul_tf32_on() -> bool:
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        return torch.backends.cuda.matmul.fp32_precision == "tf32"
    return bool(torch.backends.cuda.matmul.allow_tf32)


def test_tf32_flag_is_applied_and_recorded_on_a_gpu_recipe():
    record = backends.apply_runtime(H200_HW, MODEL, device=H200).record
    assert record["tf32"] is True and record["matmul_fp32_precision"] == "tf32" and _matmul_tf32_on()
    assert torch.get_float32_matmul_precision() == "high"
    record = backends.apply_runtime(replace(H200_HW, tf32=False), MODEL, device=H200).record
    assert record["matmul_fp32_precision"] == "ieee" and not _matmul_tf32_on()


def test_cpu_recipe_leaves_tf32_alone_and_does_not_pin_memory():
    before = torch.get_float32_matmul_precision()
    record = backends.apply_runtime(CPU_HW, MODEL, device="cpu").record
    assert torch.get_float32_matmul_precision() == before and record["tf32"] is False
    assert record["pin_memory"] is False and record["non_blocking"] is False
    assert record["mixed_precision"] == "no"


def test_gpu_record_has_pinning_compile_and_attention():
    record = backends.apply_runtime(H200_HW, replace(MODEL, compile=True), optim_cfg=FUSED, device=H200).record
    assert record["pin_memory"] is True and record["non_blocking"] is True
    assert record["compile"] is True and record["compile_mode"] == "default"
    assert record["adamw_fused"] is True and record["attn_implementation"] == "sdpa"
    assert record["mixed_precision"] == "bf16" and record["device_canonical"] == "H200 SXM"
    yaml.safe_dump(record)  # loggable as plain params


def test_speed_options_are_recorded_and_liger_is_checked_for_the_device(monkeypatch):
    model = replace(MODEL, compile=True, compile_scope="regional", kernels="liger", cross_entropy="liger")
    monkeypatch.setattr(backends, "liger_version", lambda: "0.8.5")
    record = backends.apply_runtime(H200_HW, model, device=H200).record
    assert (record["compile_scope"], record["kernels"], record["cross_entropy"]) == ("regional", "liger", "liger")
    assert record["liger_kernel_version"] == "0.8.5"
    execution = backends.execution_record({**record, "micro_batch_sequences": 8}, "nvml")
    assert execution["kernels"] == "liger" and execution["micro_batch_sequences"] == 8
    assert execution["device_busy_source"] == "nvml" and "tf32" not in execution
    # Liger's Triton kernels on a CPU: one line naming the key, never a silent fallback
    with pytest.raises(RunnerError, match="need a CUDA or ROCm GPU") as err:
        backends.apply_runtime(CPU_HW, replace(MODEL, cross_entropy="liger"), device="cpu")
    assert err.value.key == "model.cross_entropy" and "chunked" in str(err.value)
    monkeypatch.setattr(backends, "liger_version", lambda: None)
    with pytest.raises(RunnerError, match="liger-kernel is not installed; nothing is downloaded") as err:
        backends.apply_runtime(MI300X_HW, replace(MODEL, kernels="liger"), device=MI300X)
    assert err.value.key == "model.kernels"
    plain = backends.apply_runtime(CPU_HW, MODEL, device="cpu").record
    assert (plain["kernels"], plain["cross_entropy"], plain["compile_scope"]) == ("none", "plain", None)


def test_fused_adamw_request_is_honoured_or_refused(monkeypatch):
    record = backends.apply_runtime(CPU_HW, MODEL, optim_cfg=FUSED, device="cpu").record
    assert record["fused_adamw_available"] is True and record["adamw_fused"] is True
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], fused=record["adamw_fused"])
    monkeypatch.setattr(backends, "fused_adamw_available", lambda dev: False)
    with pytest.raises(RunnerError, match="optim.fused"):
        backends.apply_runtime(CPU_HW, MODEL, optim_cfg=FUSED, device="cpu")


def test_recipe_for_another_device_is_refused():
    with pytest.raises(RunnerError, match="hardware.accelerator"):
        backends.apply_runtime(MI300X_HW, MODEL, device=H200)
    with pytest.raises(RunnerError, match="hardware.device_name"):
        backends.apply_runtime(replace(H200_HW, device_name="A100"), MODEL, device=H200)


def test_missing_backend_in_model_recipe_fails_settings():
    with pytest.raises(RunnerError, match="model.attn_implementation"):
        backends.apply_runtime(MI300X_HW, replace(MODEL, attn_implementation="flash_attention_2"), device=MI300X)


@pytest.mark.parametrize(
    "hw,expected",
    [
        (H200_HW, "bf16"),
        (MI300X_HW, "bf16"),
        (replace(H200_HW, precision="fp32"), "no"),
        (replace(CPU_HW, precision="bf16"), "no"),
        (CPU_HW, "no"),
    ],
)
def test_accelerate_mixed_precision(hw, expected):
    assert backends.accelerate_mixed_precision(hw) == expected


def test_bad_precision_is_a_runner_error():
    with pytest.raises(RunnerError, match="hardware.precision"):
        backends.accelerate_mixed_precision(replace(H200_HW, precision="fp8"))


# --- accelerate launch configs ---------------------------------------------------------------


def _configs():
    return sorted(ACCEL_DIR.glob("*.yaml"))


def test_expected_configs_exist():
    assert {p.name for p in _configs()} >= {"ddp-1x8.yaml", "fsdp2-1x8.yaml", "fsdp2-Nx8.yaml"}


@pytest.mark.parametrize("path", _configs(), ids=lambda p: p.name)
def test_config_parses_with_accelerate_and_says_what_it_means(path):
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import DistributedType

    cfg = ClusterConfig.from_yaml_file(str(path))
    assert cfg.mixed_precision == backends.accelerate_mixed_precision(H200_HW)
    assert cfg.num_processes == 8 * cfg.num_machines
    if path.name.startswith("fsdp2"):
        assert cfg.distributed_type == DistributedType.FSDP
        assert cfg.fsdp_config["fsdp_version"] == 2
        assert cfg.fsdp_config["fsdp_reshard_after_forward"] is True
        assert cfg.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
        assert cfg.fsdp_config["fsdp_activation_checkpointing"] is False
        assert cfg.fsdp_config["fsdp_state_dict_type"] == "FULL_STATE_DICT"
    else:
        assert cfg.distributed_type == DistributedType.MULTI_GPU and not cfg.fsdp_config


def test_multi_node_config_names_its_rendezvous():
    from accelerate.commands.config.config_args import ClusterConfig

    cfg = ClusterConfig.from_yaml_file(str(ACCEL_DIR / "fsdp2-Nx8.yaml"))
    assert cfg.num_machines > 1 and cfg.machine_rank == 0
    assert cfg.main_process_ip and isinstance(cfg.main_process_port, int)


@pytest.mark.parametrize("name", ["fsdp2-1x8.yaml", "fsdp2-Nx8.yaml"])
def test_launch_turns_the_config_into_an_fsdp2_plugin(name, monkeypatch):
    """What `accelerate launch --config_file` hands the processes builds an FSDP2 full-shard plugin."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(
        ["--config_file", str(ACCEL_DIR / name), "-m", "runner", "launch", "experiments/1p3b.yaml"]
    )
    args, _, _ = _validate_launch_command(args)
    assert args.use_fsdp and args.module
    env = prepare_multi_gpu_env(args)
    for key, value in env.items():
        if key.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    # The plugin the runner hands Accelerator for a GPU recipe: bf16 compute, fp32 gradient reduction,
    # kept when AcceleratorState applies the launch's mixed precision (accelerate's own would reduce in bf16).
    hardware = yaml.safe_load((ROOT / "recipes/hardware/h200-1x8-fsdp.yaml").read_text())
    ours = backends.fsdp_plugin(replace(H200_HW, distributed=hardware["distributed"]))
    ours.set_mixed_precision(env["ACCELERATE_MIXED_PRECISION"])
    plugin.set_mixed_precision(env["ACCELERATE_MIXED_PRECISION"])
    assert (ours.fsdp_version, ours.reshard_after_forward) == (2, True)
    policy = ours.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert plugin.mixed_precision_policy.reduce_dtype == torch.bfloat16  # what accelerate alone would do
    acc = SimpleNamespace(distributed_type=SimpleNamespace(name="FSDP"), state=SimpleNamespace(fsdp_plugin=ours))
    assert backends.fsdp_record(acc) == {"fsdp_param_dtype": "torch.bfloat16", "fsdp_reduce_dtype": "torch.float32"}
    assert backends.fsdp_plugin(H200_HW, environ={}) is None  # DDP or one process: accelerate's defaults


def _acc(kind: str, world: int, device: str = "cuda", fsdp_version: int = 2):
    from types import SimpleNamespace

    return SimpleNamespace(
        distributed_type=SimpleNamespace(name=kind),
        num_processes=world,
        device=torch.device(device) if device == "cpu" else SimpleNamespace(type=device),
        state=SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=fsdp_version)),
    )


@pytest.mark.parametrize(
    "distributed, acc, expected",
    [
        ("fsdp", _acc("FSDP", 8), backends.SHARD_ACCELERATE),  # accelerate launch --config_file fsdp2-1x8.yaml
        ("fsdp", _acc("MULTI_CPU", 2, "cpu"), backends.SHARD_RUNNER_CPU),  # torchrun on CPU: accelerate would do DDP
        ("fsdp", _acc("NO", 1, "cpu"), backends.SHARD_NONE),  # one process holds the whole model
        ("fsdp", _acc("NO", 1), backends.SHARD_NONE),
        ("ddp", _acc("MULTI_GPU", 8), backends.SHARD_NONE),
        ("none", _acc("MULTI_CPU", 2, "cpu"), backends.SHARD_NONE),
    ],
)
def test_sharding_mode_follows_recipe_and_accelerator(distributed, acc, expected):
    assert backends.sharding_mode(HardwareRecipe(distributed=distributed), acc) == expected


@pytest.mark.parametrize(
    "distributed, acc, says",
    [
        ("ddp", _acc("FSDP", 8), "accelerate is set up for FSDP but the recipe says distributed: ddp"),
        ("fsdp", _acc("FSDP", 8, fsdp_version=1), "FSDP plugin is version 1"),
        ("fsdp", _acc("MULTI_GPU", 8), "accelerate set up MULTI_GPU over 8 processes; launch with --config_file"),
    ],
)
def test_sharding_mismatch_is_one_line_naming_the_key(distributed, acc, says):
    with pytest.raises(RunnerError) as e:
        backends.sharding_mode(HardwareRecipe(distributed=distributed), acc, file="recipes/hardware/x.yaml")
    assert says in str(e.value) and e.value.key == "hardware.distributed"


@pytest.mark.slow  # dynamo traces a DDP model: ~15 s on a loaded core
def test_compiled_ddp_graphs_stay_whole_instead_of_split_at_gradient_buckets(monkeypatch, tmp_path):
    """dynamo's DDP optimizer splits a compiled DDP model's graph at every gradient bucket; the runner
    turns it off before compiling and records what the wrapper ran with."""
    from torch._dynamo.testing import CompileCounter
    from torch.nn.parallel import DistributedDataParallel

    from runner.config.data_recipes import TokenizerRecipe
    from runner.config.schema import ExperimentSchema, TrainSection
    from runner.training.model import build_model, maybe_compile

    c = ExperimentSchema(
        # 2.6 MB of fp32 weights per layer: a few 1 MB gradient buckets (DDP's first bucket is 1 MB)
        model=ModelRecipe(hidden_size=256, n_layers=2, n_heads=4, n_kv_heads=4, intermediate_size=512, compile=True),
        tokenizer=TokenizerRecipe(vocab_size=100, eos_id=0),
        train=TrainSection(seq_len=16),
        hardware=HardwareRecipe(accelerator="cpu"),
    )

    # torch's default, put back after by hand: pytest 9.2's monkeypatch undoes a module attribute it
    # cannot see in the module's __dict__ with delattr, which hides the option from torch for good
    before = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = True
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        torch._dynamo.reset()
        ddp = DistributedDataParallel(build_model(c), bucket_cap_mb=1, broadcast_buffers=False)
        record = backends.ddp_compile_settings(ddp, True)
        counter = CompileCounter()  # dynamo's DDP optimizer on: a graph per gradient bucket
        maybe_compile(ddp, c, backend=counter)
        x = torch.randint(0, 100, (2, 16))
        ddp(input_ids=x, loss_targets=x, loss_mask=torch.ones_like(x, dtype=torch.bool)).backward()
    finally:
        torch.distributed.destroy_process_group()
        torch._dynamo.reset()
        torch._dynamo.config.optimize_ddp = before
    assert counter.frame_count == 1
    assert record == {"ddp_broadcast_buffers": False, "ddp_bucket_cap_mb": 1.0, "dynamo_optimize_ddp": False}
