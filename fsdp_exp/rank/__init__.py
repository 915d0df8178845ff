"""The rank: what runs inside each rank process, whichever launcher started it.

`worker.run_rank` (its variables, logging, time limit) runs the task's rank function
(`train.train_rank`, ...), which joins the process group (`distributed`), builds the
object graph (`build`: the sharded model, data, optimizer, checkpointer, metric sinks),
and runs `trainer.Trainer.fit`, whose hooks in `report` add the figures known once training ended.
Nothing here knows Hydra.
"""
