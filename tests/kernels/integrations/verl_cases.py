"""What the verl tests share: verl's actor config as its policy losses read it (`Config`) and verl's
loss aggregation modes with the batch information each reads (`AGG_CASES`)."""


class Config(dict):
    """verl's ActorConfig as the policy losses use it: attributes plus `.get`."""

    __getattr__ = dict.__getitem__


#: case name -> (verl's ``loss_agg_mode``, its ``global_batch_info``)
AGG_CASES = {
    "token-mean": ("token-mean", {}),
    "token-mean-global": ("token-mean", dict(dp_size=2, batch_num_tokens=30)),
    "token-sum": ("token-sum", {}),
    "seq-mean-token-mean": ("seq-mean-token-mean", {}),
    "seq-mean-token-sum": ("seq-mean-token-sum", dict(global_batch_size=5)),
    "seq-mean-token-sum-norm": ("seq-mean-token-sum-norm", dict(loss_scale_factor=8)),
}
