"""What every op stands on: the CUDA extension's build and loading, its sources, argument checks,
dropout state, edge plans (:class:`EdgePlan`) and CSR pointers of edges grouped by destination."""
