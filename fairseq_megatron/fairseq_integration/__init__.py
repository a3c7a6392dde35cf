"""Everything the plugin changes in an installed fairseq 0.12.

Called once by ``import fairseq_megatron`` (which ``--user-dir`` triggers in
every process, before fairseq initialises torch.distributed). Each step
fixes one fact listed in the project's FAIRSEQ_FACTS.md, or a fairseq bug
that model parallelism runs into; the modules of this package group the
steps by what they are about, and each module's docstring says, step by
step, what fairseq did and what it does now. Other files cite them as
"fairseq_integration step N". In the order :func:`install` applies them:

 1. :func:`megatron_submodule.provide_mpu`
 2. :func:`megatron_submodule.enable_megatron_trainer`
 3. :func:`launch.launch_on_cpu`
 4. :func:`checkpoint_files.trusted_checkpoint_loading`
 5. :func:`evaluation.shard_by_data_parallel_rank`
 6. :func:`generate_and_interactive.model_parallel_generate`
 7. :func:`launch.data_parallel_only`
 8. :func:`trainer.fused_adam_without_apex`
 9. :func:`trainer.step_log_without_device_wait`
10. :func:`trainer.quiet_prefetch_threads_at_exit`
11. :func:`trainer.padding_known_on_the_host`
12. :func:`trainer.nonfinite_gradients_skipped_on_the_device`
13. :func:`checkpoints_at_another_size.checkpoints_at_another_model_parallel_size`
14. :func:`one_line_errors.one_line_errors`
15. :func:`checkpoints_at_another_size.training_from_checkpoints_at_another_size`
16. :func:`checkpoint_files.broadcast_from_a_rank_of_the_group`
17. :func:`launch.spawned_processes_install_the_plugin`
18. :func:`evaluation.fairseq_validate_across_ranks`
19. :func:`evaluation.evaluation_scores_every_sample`
20. :func:`checkpoint_files.resuming_at_another_data_parallel_size`
21. :func:`checkpoint_files.keep_best_checkpoints_of_model_parts`
22. :func:`checkpoint_files.checkpoint_copies_written_whole`
23. :func:`checkpoint_files.part_names_under_directories_with_pt`
24. :func:`launch.launch_checked_before_fairseq_train_writes`
25. :func:`trainer.finished_training_left_as_it_is`
26. :func:`checkpoint_files.models_for_a_checkpoint_skip_initialisation`
27. :func:`checkpoint_files.training_draws_initial_weights_only_without_a_checkpoint`

:mod:`.patching` holds the means they share: stand-ins for a module as one
fairseq module sees it, and names replaced in the ``fairseq_cli`` modules.
"""

from fairseq_megatron.fairseq_integration import (
    checkpoint_files,
    checkpoints_at_another_size,
    evaluation,
    generate_and_interactive,
    launch,
    megatron_submodule,
    one_line_errors,
    trainer,
)

_INSTALLED = False


def install() -> None:
    """Apply all integration steps (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    megatron_submodule.provide_mpu()
    megatron_submodule.enable_megatron_trainer()
    launch.launch_on_cpu()
    checkpoint_files.trusted_checkpoint_loading()
    evaluation.shard_by_data_parallel_rank()
    generate_and_interactive.model_parallel_generate()
    launch.data_parallel_only()
    trainer.fused_adam_without_apex()
    trainer.step_log_without_device_wait()
    trainer.quiet_prefetch_threads_at_exit()
    trainer.padding_known_on_the_host()
    trainer.nonfinite_gradients_skipped_on_the_device()
    checkpoints_at_another_size.checkpoints_at_another_model_parallel_size()
    one_line_errors.one_line_errors()
    checkpoints_at_another_size.training_from_checkpoints_at_another_size()
    checkpoint_files.broadcast_from_a_rank_of_the_group()
    launch.spawned_processes_install_the_plugin()
    evaluation.fairseq_validate_across_ranks()
    evaluation.evaluation_scores_every_sample()
    checkpoint_files.resuming_at_another_data_parallel_size()
    checkpoint_files.keep_best_checkpoints_of_model_parts()
    checkpoint_files.checkpoint_copies_written_whole()
    checkpoint_files.part_names_under_directories_with_pt()
    launch.launch_checked_before_fairseq_train_writes()
    trainer.finished_training_left_as_it_is()
    checkpoint_files.models_for_a_checkpoint_skip_initialisation()
    checkpoint_files.training_draws_initial_weights_only_without_a_checkpoint()
    _INSTALLED = True
