"""Starting and stopping what a run needs: engine groups, trainer ranks, the weight hand-off.

- `plan`: the launch plan (each process's role, place, argv, environment), decided before anything starts.
- `show`: a launch plan on the console (`patchgym run --dry-run`).
- `placement`: trainer ranks' and engines' bundles placed on the nodes `cluster.nodes` lists (the dry run).
- `memory`: GPU memory estimates of trainer ranks and engines, checked against their GPUs.
- `engines`: the `sglang` backend factory (attach by URLs, or start N servers behind the router).
- `ranks`: the `megatron` backend factory (rank 0 here, the other ranks started and watched).
- `processes`: the supervisor of child processes (own sessions, die with the driver, pid records).
- `lifecycle`: start, watch (a dead process stops the run at once) and close the parts of a run.
- `sync`: the weight sync (tensor, distributed, disk) with its report and probe check.
- `context`: where started processes log (`RUN_DIR/logs/` inside `patchgym run`).
"""
