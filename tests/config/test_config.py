"""Configuration: every key a recipe or override sets is used or rejected by ``load_config``, before a run
directory exists; task <-> data module <-> model head are cross-checked."""

from __future__ import annotations

import pytest

from mega_suite.config import ConfigError, load_config


def test_max_length_is_rejected_where_the_data_module_does_not_use_it(tmp_path):
    # SC10 clips are 16000 samples and ImageNet gives (image_size / patch_size)**2 patches: nothing to truncate.
    for recipe in ("sc_raw", "imagenet"):
        with pytest.raises(ConfigError, match=rf"data\.max_length=8000.*data\.name='{recipe}'"):
            load_config([f"recipe={recipe}", "data.max_length=8000", f"run_root={tmp_path}"])
        load_config([f"recipe={recipe}"])  # the recipes themselves no longer set it
    # pixel tasks have images of a fixed size: only that length is accepted
    with pytest.raises(ConfigError, match=r"data\.max_length=2048.*1024"):
        load_config(["recipe=lra_image", "data.max_length=2048"])
    assert load_config(["recipe=lra_listops", "data.max_length=256"]).data.max_length == 256
    assert not list(tmp_path.iterdir()), "nothing is written by load_config"


def test_pad_to_multiple_is_rejected_where_unused():
    with pytest.raises(ConfigError, match=r"data\.pad_to_multiple=8.*data\.name='wt103'"):
        load_config(["recipe=wt103", "data.pad_to_multiple=8"])


def test_data_options_are_validated_in_load_config(tmp_path):
    with pytest.raises(
        ConfigError, match=r"data\.options.*'bucket_batchez'.*data\.name='listops'.*bucket_batches"
    ):
        load_config(["recipe=debug", "data.options.bucket_batchez=3", f"run_root={tmp_path}"])
    # shared keys have one place: data.batch_size, not data.options.batch_size
    with pytest.raises(ConfigError, match=r"data\.options\.batch_size.*data\.batch_size"):
        load_config(["recipe=debug", "data.options.batch_size=3"])
    with pytest.raises(ConfigError, match=r"data\.name='listopz'.*listops"):
        load_config(["recipe=debug", "data.name=listopz"])
    assert not list(tmp_path.iterdir())


def test_task_must_match_the_data_module():
    with pytest.raises(ConfigError, match=r"task=lm.*data\.name='listops'.*classify"):
        load_config(["recipe=lra_listops", "task=lm"])
    with pytest.raises(ConfigError, match=r"task=classify.*data\.name='wt103'.*lm"):
        load_config(["recipe=wt103", "task=classify"])


def test_model_head_must_match_the_data_module():
    # a language model with a classification head
    with pytest.raises(ConfigError, match=r"model\.num_classes=10.*task=lm"):
        load_config(["recipe=wt103", "model.num_classes=10"])
    # a class count that the data does not have was silently replaced by the data's
    with pytest.raises(ConfigError, match=r"model\.num_classes=5.*data\.name='listops'.*10"):
        load_config(["recipe=lra_listops", "model.num_classes=5"])
    with pytest.raises(ConfigError, match=r"model\.input_type='token'.*data\.name='lra_image'.*'scalar'"):
        load_config(["recipe=lra_image", "model.input_type=token"])
    with pytest.raises(ConfigError, match=r"model\.dual_input=False.*data\.name='lra_retrieval'"):
        load_config(["recipe=lra_retrieval", "model.dual_input=false"])
    # the class count of ImageNet follows data.options.num_classes (a preset's value is a placeholder)
    assert load_config(["recipe=imagenet", "data.options.num_classes=3"]).model.num_classes == 3
    with pytest.raises(ConfigError, match=r"model\.num_classes=7.*data\.name='imagenet'.*3"):
        load_config(["recipe=imagenet", "data.options.num_classes=3", "model.num_classes=7"])


def test_keys_that_do_not_apply_are_rejected():
    with pytest.raises(ConfigError, match=r"trainer\.peak_tflops.*task=lm"):
        load_config(["recipe=lra_listops", "trainer.peak_tflops=989"])
    with pytest.raises(ConfigError, match=r"trainer\.global_batch_tokens.*task=lm"):
        load_config(["recipe=lra_listops", "trainer.global_batch_tokens=65536"])
    with pytest.raises(ConfigError, match=r"trainer\.accumulate_grad_batches=4.*global_batch_tokens"):
        load_config(["recipe=llm_200m", "trainer.accumulate_grad_batches=4"])
    with pytest.raises(ConfigError, match=r"init_from.*mode=fit"):
        load_config(["recipe=debug", "init_from=x.ckpt", "mode=test", "ckpt=x.ckpt"])
    with pytest.raises(ConfigError, match=r"ckpt=x\.ckpt.*mode=fit.*resume"):
        load_config(["recipe=debug", "ckpt=x.ckpt"])
    with pytest.raises(ConfigError, match=r"mode=test needs ckpt"):
        load_config(["recipe=debug", "mode=test"])
    with pytest.raises(ConfigError, match=r"mode=eval_context.*task=lm"):
        load_config(["recipe=debug", "mode=eval_context"])
    with pytest.raises(ConfigError, match=r"eval_max_documents.*mode=eval_context"):
        load_config(["recipe=wt103", "eval_max_documents=3"])


def test_label_smoothing_is_honoured_without_mixup():
    """DeiT's label smoothing 0.1 applies to hard labels too: with mixup and cutmix off it was ignored."""
    import torch

    from mega_suite.config.run_plan import make_plan
    from mega_suite.training.runner import build_run_module

    cfg = load_config(
        ["recipe=imagenet", "data.options.mixup_alpha=0", "data.options.cutmix_alpha=0",
         "data.options.label_smoothing=0.2", "data.options.num_classes=4", "model.num_layers=1",
         "model.model_dim=16", "model.z_dim=8", "model.value_dim=16", "model.ffn_hidden_dim=16",
         "model.norm_num_groups=4", "model.cema_ndim=2", "model.image_size=32", "model.chunk_size=4"]
    )  # fmt: skip
    module = build_run_module(make_plan(cfg))
    logits = torch.randn(6, 4, dtype=torch.float64)
    label = torch.tensor([0, 1, 2, 3, 1, 0])
    logp = torch.log_softmax(logits, -1)
    target = torch.full((6, 4), 0.2 / 4, dtype=torch.float64)
    target[torch.arange(6), label] += 0.8
    expected = -(target * logp).sum(-1).mean()
    torch.testing.assert_close(module.loss(logits, label), expected, rtol=1e-12, atol=0)


def test_every_data_module_declares_its_contract():
    """Each data module's contract (datamodules/contracts.py, read without importing the module) says what it
    feeds the model (task, input type, document pairs); a classifier's data has a class count; an unknown
    name is refused with the nearest ones."""
    from datamodules.contracts import CONTRACTS
    from mega_suite.config import ConfigError, data_contract

    inputs = {"listops": "token", "lra_text": "token", "lra_retrieval": "token", "lra_image": "scalar",
              "lra_pathfinder": "scalar", "lra_pathx": "scalar", "sc_raw": "scalar", "imagenet": "patch"}  # fmt: skip
    for name in CONTRACTS:
        contract = data_contract(name)
        assert contract.input_type == inputs.get(name, "token"), name
        assert contract.dual_input == (name == "lra_retrieval"), name
        assert (contract.task == "classify") == (
            contract.num_classes is not None or "num_classes" in contract.options
        )
    with pytest.raises(ConfigError, match="data.name='listop' is unknown; nearest: \\['listops'"):
        data_contract("listop")


def test_wt103_global_batch_is_the_papers_147456_tokens_on_any_device_count():
    """6144 tokens x 24 GPUs; sequences of k ~ U{2..6} chunks of 2048 tokens average 8192 tokens."""
    from mega_suite.config.run_plan import make_plan

    for devices, accumulate in ((1, 18), (8, 2), (24, 1)):
        plan = make_plan(load_config(["recipe=wt103", f"trainer.devices={devices}"]))
        assert plan.accumulate_grad_batches == accumulate == max(1, round(147456 / (8192 * devices)))
        assert plan.tokens_per_sequence == 8192 and plan.world == devices


def test_compile_mode_is_checked_before_any_work():
    compiled = ["recipe=debug", "trainer.compile=true"]
    with pytest.raises(ConfigError, match=r"trainer\.compile_mode='reduce_overhead'.*reduce-overhead"):
        load_config([*compiled, "trainer.compile_mode=reduce_overhead"])
    with pytest.raises(ConfigError, match=r"compile_mode='reduce-overhead' is an Inductor mode.*'aot_eager'"):
        load_config([*compiled, "trainer.compile_backend=aot_eager", "trainer.compile_mode=reduce-overhead"])
    with pytest.raises(ConfigError, match=r"compile_mode='max-autotune' applies with trainer\.compile=true"):
        load_config(["recipe=debug", "trainer.compile_mode=max-autotune"])
    assert (
        load_config([*compiled, "trainer.compile_mode=max-autotune"]).trainer.compile_mode == "max-autotune"
    )


@pytest.mark.parametrize(
    "override, match",
    [("trainer.accumulate_grad_batches=2", r"cannot accumulate gradients.*accumulate_grad_batches=2"),
     ("trainer.strategy=fsdp", r"fixed parameter addresses.*strategy='fsdp'"),
     ("trainer.gradient_checkpointing=true", r"gradient_checkpointing=true is untested"),
     ("mode=validate ckpt=last.ckpt", r"for training \(mode=fit\); mode='validate'")],
)  # fmt: skip
def test_cuda_graph_compile_modes_refuse_what_breaks_them(override, match):
    """reduce-overhead / max-autotune keep outputs and gradients in graph memory the next step overwrites:
    combinations where that breaks (or is untested) are refused at load, naming the way out; the modes
    without CUDA graphs accept them."""
    base = ["recipe=debug", "trainer.compile=true"]
    with pytest.raises(ConfigError, match=match + r".*compile_mode=default or max-autotune-no-cudagraphs"):
        load_config([*base, "trainer.compile_mode=reduce-overhead", *override.split()])
    load_config([*base, "trainer.compile_mode=max-autotune-no-cudagraphs", *override.split()])


def test_cuda_graph_mode_refuses_the_accumulation_a_global_batch_sets():
    """trainer.global_batch_tokens sets the accumulation (config.resolve.accumulation): the check reads it at
    load, before anything is created."""
    with pytest.raises(ConfigError, match=r"cannot accumulate gradients.*global_batch_tokens"):
        load_config(["recipe=kjv", "trainer.compile=true", "trainer.compile_mode=reduce-overhead",
                     "trainer.global_batch_tokens=1000000", "trainer.accelerator=cpu"])  # fmt: skip


def test_float32_matmul_precision_is_checked_and_set_by_every_run(tmp_path):
    """``trainer.float32_matmul_precision`` (TF32 for the float32 logits head on a GPU) is checked at load, and every trainer built sets it, also back to the
    default, so that one run's choice does not leak into the next run of the same process."""
    import torch

    from mega_suite.config.run_plan import make_plan
    from mega_suite.training.runner import build_trainer

    with pytest.raises(ConfigError, match=r"float32_matmul_precision='tf32'; expected one of highest, high"):
        load_config(["recipe=debug", "trainer.float32_matmul_precision=tf32"])
    try:
        for value in ("high", "highest"):
            cfg = load_config(["recipe=debug", f"trainer.float32_matmul_precision={value}"])
            build_trainer(make_plan(cfg), tmp_path / value)
            assert torch.get_float32_matmul_precision() == value
    finally:
        torch.set_float32_matmul_precision("highest")
