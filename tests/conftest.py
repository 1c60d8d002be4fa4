"""Shared pytest fixtures."""

import pytest
import torch


@pytest.fixture(scope="module")
def single_thread():
    """Tiny models: one intra-op thread is faster than two and does not oversubscribe CI's cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# The quick tier (`pytest -m "not slow"`, README): the integration tests that start processes (gloo, torchrun,
# accelerate, the recipes' subprocesses), run the benchmarks' smoke runs or train reference runs are marked `slow`
# here, by file or by test name (the slowest of the full suite, `pytest --durations=60`); CI runs everything.
SLOW_FILES = ("test_fsdp.py", "test_fsdp_checkpoint.py", "test_distributed.py", "test_distributed_units.py", "test_benchmark_smoke.py",
              "test_faults.py", "test_accounting_crosscheck.py", "test_fsdp_resume_release.py", "test_sensitivity_fsdp.py",
              "test_dpo_distributed.py", "test_correlated_distributed.py",
              "test_correlated_fsdp.py")
SLOW_TESTS = (
    "test_trainer_path_replay_resume_is_a_violation", "test_trainer_path_replay_train_is_a_violation",
    "test_bound_holds_and_is_close_on_the_gaussian_mechanism", "under_fsdp2_with_two_processes",
    "test_two_gloo_processes_run_the_recipe_over_user_units", "test_the_issues_done_when_command_end_to_end",
    "test_planner_chooses_the_batch_when_none_is_given", "test_log_to_a_file_has_no_escape_codes",
    "test_ranks_holding_other_data_orders_or_settings_are_refused", "test_sigma_is_the_accountants_and_meets_the_target",
    "test_offline_hub_message_exit_code_2_no_traceback", "test_qnli_help_says_its_own_usage",
    "test_target_epsilon_stops_a_resumed_run_instead_of_exceeding_it", "test_ddp_ranks_train_on_rank_0s_draw",
    "test_cli_module_runs", "test_the_recipe_scores_privately_on_a_random_holdout",
    "test_two_gloo_processes_run_dp_sft_over_user_units",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_FILES or any(name in item.name for name in SLOW_TESTS):
            item.add_marker(pytest.mark.slow)


def pytest_collection_finish(session):
    """The modules collection imported (torch, transformers, datasets, hf_dp, the tests) stay to the end of the run:
    move them out of the garbage collector's full passes (``gc.freeze``), which otherwise walk that whole heap at
    every ``gc.collect()`` (one per trial of a private search, HF's own) and every automatic full collection."""
    import gc

    gc.collect()
    gc.freeze()
