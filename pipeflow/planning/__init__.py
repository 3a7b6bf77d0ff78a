"""Planning: profiling layers and transfers, partition and balance, placement, the planner and the
cost model it shares with the start-of-run prediction. It never imports the run."""
