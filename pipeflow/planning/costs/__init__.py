"""The cost models the planner and the start-of-run prediction share: the roofline of a layer on
a GPU, the collectives of tp, cp and ep, transfers on a link, and the runtime's own timings."""
