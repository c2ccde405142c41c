"""The one error type of the planners: a request no plan can satisfy, said in plain words."""


class PlanError(ValueError):
    """No plan exists for the request (too few nodes, too little memory, bad arguments)."""
