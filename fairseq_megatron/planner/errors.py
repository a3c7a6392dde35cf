"""The planner's one error."""


class PlanError(ValueError):
    """A request that no layout can satisfy, or a value the planner cannot
    plan with, with the reason (the command line prints it as one line)."""
