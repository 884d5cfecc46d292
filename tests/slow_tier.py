"""The slow tier: tests that `make test` (the CI run) leaves to `make test-slow`. `make test-all` runs both.

What is here (and, marked in tests/test_readme.py, the docs/ pages' commands) and why: whole programs run end to end
(train.py and the docs' commands in subprocesses, kill / signal / multi-process runs, meshes of 8 emulated CPU
devices) and the heaviest numerics tests (a whole model compiled per recipe, the kernels' interpreter runs at
several shapes). Each covers code that a faster test in the default run also reaches: the default run reaches every
qjax module (in-process line coverage 91.8% against 93.9% for the whole suite, 2026-11-28; pytest-cov with
--cov-context=test). tests/test_slow_tier.py checks the names. Of a parametrized function listed in SLOW_TESTS the
first case stays in the default run, so the listed test body still runs there once; a name ending in [*] marks every
case.
"""

import pytest

# Whole files: every test in them is slow.
SLOW_FILES = {
    "tests/test_docs.py",  # docs/' Python blocks, each a script in a subprocess
    "tests/test_mesh_gpu.py",  # FSDP steps on emulated Hopper meshes
    "tests/train/test_fsdp.py",  # train() over several meshes against one device
    "tests/train/test_train_kill.py",  # SIGKILL mid-run, restart, compare
    "tests/train/test_train_interrupt.py",  # SIGINT / SIGTERM mid-run and mid-save
    "tests/train/test_multihost.py",  # two processes as one
    "tests/test_fsdp_memory.py",  # compiled memory of FSDP steps
    "tests/test_bitnet_fsdp.py",  # ternary codes gathered over a mesh
    "tests/test_dot_general_mesh.py",  # per-device GEMMs on 8 emulated devices
    "tests/optim/test_sharding.py",  # the optimizer over 8 emulated devices
}

# file -> test functions (without their parameters)
SLOW_TESTS = {
    "tests/test_scaling_bench.py": {"test_runs_on_two_cpu_devices_with_row_options"},
    "tests/kernels/test_dispatch.py": {
        "test_forced_interpret_runs_the_kernels_inside_dot_general", "test_pallas_backend_matches_xla_through_the_vjp",
    },
    "tests/kernels/test_grouped_matmul_mgpu.py": {
        "test_contract_kernel_equals_reference", "test_fp8_contract_kernel", "test_kernel_equals_reference",
        "test_lowers_for_cuda", "test_precise_fp8_promotes", "test_ragged_dot_runs_kernel_and_matches_reference",
    },
    "tests/kernels/test_quantize_mgpu.py": {
        "test_grouped_pair_runs_grouped_kernel", "test_lowers_for_hopper", "test_pair_matches_reference",
        "test_valid_rows_read_as_zeros",
    },
    "tests/kernels/test_rmsnorm_mgpu.py": {"test_llama_int8_dataflow_with_kernels_equals_reference_path"},
    "tests/kernels/test_swiglu_mgpu.py": {
        "test_kernels_match_reference", "test_llama_with_kernels_equals_reference_path",
    },
    "tests/models/test_dataflow.py": {
        "test_close_to_float32_with_per_parameter_gradient_snr", "test_recompute_attention",
        "test_recomputed_prologue_outputs", "test_training_tracks_bf16[*]", "test_vit_layer_norm_and_gelu_flow[*]",
    },
    "tests/models/test_generate.py": {
        "test_generate_runs_recipes_that_round_stochastically", "test_quantized_inference_logits_snr[*]",
    },
    "tests/models/test_gpt2.py": {
        "test_bf16_recipe_is_the_float_reference_and_causal",
        "test_dataflow_close_to_float32_with_per_parameter_gradient_snr[*]", "test_trains_from_the_config_file",
    },
    "tests/models/test_hf_llama.py": {"test_qjax_init_saves_and_loads"},
    "tests/models/test_llama.py": {"test_every_recipe_trains_close_to_bf16"},
    "tests/models/test_lm_head.py": {"test_bf16_compute_and_mask", "test_equals_full_logits_float32"},
    "tests/models/test_moe.py": {"test_quantized_moe_llama_trains_and_reports_its_aux_loss"},
    "tests/models/test_ops.py": {
        "test_llama_matches_the_plain_formulation", "test_vit_matches_flax_layer_norm_and_gelu",
    },
    "tests/models/test_vit.py": {"test_every_recipe_traces", "test_recipes_train_close_to_float32"},
    "tests/optim/test_adam.py": {
        "test_inside_optax_chain_after_clipping", "test_mlp_training_tracks_fp32",
        "test_update_equals_the_optax_chain_bit_for_bit",
    },
    "tests/optim/test_checkpoint.py": {"test_orbax_roundtrip_and_resume"},
    "tests/optim/test_clip_folding.py": {
        "test_clipped_kernel_lowers_for_hopper", "test_folded_bf16_sr_step_equals_the_step_on_clipped_gradients",
        "test_folded_step_equals_optax_clip_then_adamw", "test_kernel_clip_matches_reference",
    },
    "tests/optim/test_fused_kernel.py": {
        "test_apply_gradients_kernel_equals_optax_path", "test_bf16_params_with_stochastic_rounding", "test_block_128",
        "test_chain_fused_clips_then_takes_the_kernel", "test_kernel_matches_reference", "test_lowers_for_hopper",
        "test_zero_gradient",
    },
    "tests/optim/test_maps.py": {"test_encode_equals_brute_force"},
    "tests/optim/test_step_memory.py": {
        "test_bf16_params_with_stochastic_rounding_8bit_under_5_bytes_per_param",
        "test_low_bit_step_peaks_at_most_half_of_fp32_adamw",
        "test_streamed_step_is_bit_identical_to_the_unstreamed_one",
    },
    "tests/test_bitnet.py": {"test_tiny_llama_trains_with_bitnet"},
    "tests/test_convergence_table.py": {"test_a_run_stopped_mid_way_saves_its_step_and_resumes_to_the_same_evals"},
    "tests/test_convert.py": {
        "test_fsdp_on_a_2x2_cpu_mesh",
        "test_linen_under_scan_remat_jit_grad",
    },
    "tests/test_convert_llama.py": {"test_plain_llama_converted_is_bit_identical_to_the_explicit_llama"},
    "tests/test_dot_general.py": {
        "test_any_dimension_numbers", "test_exact_on_losslessly_quantizable_inputs", "test_fp8_snr",
        "test_int8_rowwise_snr_above_20db", "test_jit_vmap_scan_remat_agree_with_eager[*]",
        "test_non_finite_inputs_stay_visible",
    },
    "tests/test_flax.py": {"test_dense_drop_in"},
    "tests/test_health.py": {
        "test_model_warns_when_an_outlier_channel_is_injected", "test_nothing_is_traced_when_health_is_off",
        "test_smooth_swiglu_matches_the_unguarded_model[*]",
        "test_train_writes_health_rows_and_stays_quiet_on_a_clean_run",
    },
    "tests/test_prologue.py": {"test_forward_and_wgrad_bit_exact_dgrad_close"},
    "tests/test_ragged_dot.py": {"test_jit_vmap_scan_grad", "test_snr"},
    "tests/test_recompute_weight_codes.py": {
        "test_fsdp_gathers_the_recomputed_codes_and_matches_one_device", "test_kernel_path_with_a_float32_weight",
        "test_llama_bf16_params_bit_identical_with_less_saved[*]",
        "test_llama_float32_params_saves_neither_codes_nor_a_cast",
    },
    "tests/train/test_finetune.py": {"test_finetune_loss_falls"},
    "tests/train/test_generate_cli.py": {
        "test_generates_from_the_newest_checkpoint", "test_sampling_several_continuations",
    },
    "tests/train/test_int8_weight_only.py": {
        "test_int8_params_step_needs_no_more_memory_than_bf16_params_with_sr",
        "test_int8_weight_only_run_falls_and_resumes_bit_identically",
        "test_stored_codes_on_8_cpu_devices_match_unsharded",
    },
    "tests/train/test_train_cli.py": {
        "test_command_line_mistakes_are_one_line_naming_the_fix",
        "test_divergence_is_one_line_and_keeps_the_last_good_checkpoint",
        "test_misspelled_field_is_one_line_naming_the_closest_field",
    },
    "tests/train/test_train_config.py": {"test_train_runs_each_check_once"},
    "tests/train/test_train_convert.py": {
        "test_converted_model_trains_in_int8_and_resumes_bit_identically",
        "test_converted_model_under_fsdp_on_two_cpu_devices",
    },
    "tests/train/test_train_loop.py": {
        "test_accumulated_data_parallel_step_equals_the_big_batch_step",
        "test_bf16_params_with_stochastic_rounding_train_and_resume_bit_identically",
        "test_vit_run_falls_resumes_bit_identically_and_stops_on_nan",
    },
    "tests/train/test_train_optimizer.py": {"test_step_is_clipping_then_the_bare_adamw"},
    "tests/train/test_vit_finetune.py": {"test_finetune_loss_falls_and_says_the_head_is_new"},
    # meshes of 8 emulated devices
    "tests/optim/test_fused_mesh.py": {"test_per_device_step_on_8_cpu_devices_equals_unsharded", "test_shard_offsets"},
    # corrupted / foreign checkpoints and restarts, each a few train() runs (the metrics rollback, TensorBoard and
    # plot tests stay in the default run)
    "tests/train/test_train_workdir.py": {
        "test_unreadable_newest_checkpoint_is_moved_aside_and_the_run_resumes_from_the_previous[*]",
        "test_no_readable_checkpoint_is_one_error_line_and_nothing_is_moved",
        "test_checkpoint_of_another_model_is_an_error_not_a_corrupt_checkpoint",
        "test_shorter_steps_than_the_checkpoint_is_an_error_and_changes_are_listed",
        "test_best_checkpoint_by_eval_loss_is_kept_and_resume_takes_the_newest",
        "test_a_start_from_scratch_sets_an_earlier_runs_metrics_aside",
    },
}


def mark(items) -> None:
    """Marks the tests listed here `slow`; of a listed parametrized function the first case stays unmarked, unless it is
    listed as NAME[*]."""
    first_seen = set()
    for item in items:
        path, _, name = item.nodeid.partition("::")
        function = name.partition("[")[0]
        listed_names = SLOW_TESTS.get(path, ())
        listed = function in listed_names or f"{function}[*]" in listed_names
        if function in listed_names and hasattr(item, "callspec") and (path, function) not in first_seen:
            first_seen.add((path, function))
            continue
        if listed or path in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
