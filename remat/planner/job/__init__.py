"""The job a plan is made for, before any plan: sizes and budgets (`budget`), the training
setup and its state's bytes (`training`), the step's memory terms (`accounting`), tensor
parallel layouts (`tensor_layout`) and the ranks of a distributed job (`ranks`). The lowest
floor of `remat.planner`."""
