"""The process group and the hosts under it: joining it under one deadline, the timeouts pipeflow
sets on every group, which host each rank runs on, the hosts' clocks, and tearing it down."""
