"""``deepspeed.launcher``: the ``deepspeed`` command's single-node launcher (`runner`)."""
