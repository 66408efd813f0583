"""Benchmark of :func:`edgedot.edge_dot`, :func:`edgedot.graph_attention` and the GAT ops against PyTorch and PyG.

``edge_dot`` is compared with eager PyTorch, ``torch.compile`` and cuSPARSE; ``graph_attention``
with PyG's ``TransformerConv`` and ``torch.compile`` of the unfused math; ``gat_attention`` /
``gatv2_attention`` with PyG's ``GATConv`` / ``GATv2Conv``, ``torch.compile`` of the unfused
math and Turbo-GNN's ``gatv2_aggr``; ``graph_attention`` with edge features with ``torch.compile``
and anemoi's Triton GraphTransformer (``anemoi.models.triton.gt``).

Run ``python -m edgedot.bench`` on a CUDA device (``--help`` lists the options; ``--quick`` runs
every case at a tiny size, also on the CPU, as a smoke test of the code paths). Without CUDA it
refuses the full sizes (hours on a CPU) with a usage error unless ``--full-on-cpu`` asks for
them; bad ``--cases`` or ``--reps-scale`` values are usage errors naming the option.

Modules: ``__main__`` (command line), ``timing`` (clocks, bandwidth probes, the measurement of
one path), ``graphs`` (the random edge lists: uniform and R-MAT), ``cases`` (the edge_dot cases
and input sets), ``edge_dot`` (its expected results, bytes and paths), ``attention`` and
``attention_check`` (the attention cases, paths and their float64 check), ``gat`` (the GAT /
GATv2 cases, ``gat_*`` and ``gatv2_*``, on the attention cases' graphs, their paths and float64
check: see its docstring), ``edge_attention`` (attention with edge features, ``edge_attn_*``,
beside anemoi's kernel), ``report`` (tables, JSON, chart).

Cases (``CASES`` and ``ATTENTION_CASES``; ``--cases`` picks some by name)
    ``default`` is the seed's problem (int32 indices); the others use int64 indices. "mid" is
    100k nodes a side and 2M edges, "large" 2.45M nodes and 2**24 edges; edges are uniform
    random pairs, "sorted" ones ordered by src. ``heads_bf16`` is the large sorted graph with
    ``[N, 4, 32]`` bfloat16 features. ``rmat`` is a Graph500 R-MAT graph (scale 22, edge factor
    4: 2**24 edges, node ids randomly relabelled, edges in random order).
    Attention (``attn_*``): graphs of the sizes of ogbn-arxiv (169,343 nodes, 1,166,243 edges;
    float32 and bfloat16), ogbn-products (2,449,029 nodes, 30M edges; bfloat16) and Reddit
    (232,965 nodes, 114,615,892 edges; bfloat16): uniform random edges sorted by destination
    (int64, PyG's ``edge_index``), 4 heads of 32, node features ``x`` ``[N, 128]`` for the
    layers and random ``q``, ``k``, ``v`` ``[N, 4, 32]`` for the op; sampled mini-batches
    (``*_minibatch*``: 16,384 seeds with 5, 10 or 25 in-edges from 180,224 nodes, a new graph
    every call). GAT and GATv2 (``gat_*``, ``gatv2_*``) run on the same graphs, and GATv2 also
    at the real ogbn-products size (123,718,280 edges). Attention with ``[E, 4, 32]`` edge
    features (``edge_attn_*``, float16) at arxiv and products sizes.

Paths
    Forward: ``eager`` (:func:`edgedot.edge_dot_reference`), ``compile`` (``torch.compile`` of it,
    ``dynamic=False``, recompiled for each case and warmed before timing; a recompile during a
    timed loop raises), ``cusparse`` (``torch.sparse.sampled_addmm(mask, src_feat, dst_feat.T)``
    on a CSR mask of the unique (src, dst) pairs sorted by src, so it computes E_unique <= E dots;
    the mask is built beforehand and only the ``sampled_addmm`` call is timed; CUDA, float32 and
    float64 only, no heads), ``edgedot`` (the default: index check on; an index tensor found in
    range is remembered, so after the warm-up the rotated sets are not checked again),
    ``edgedot_fresh`` (the default on new index tensor objects every call, so every call is
    checked and waits for it) and ``edgedot_nocheck`` (``check_indices=False``).
    Forward+backward: ``eager``, ``compile``, ``edgedot`` (default mode, no plan),
    ``edgedot_det`` (``deterministic=True``, no plan: the edges are sorted in every backward) and
    ``edgedot_plan`` (an :class:`edgedot.EdgePlan` per input set, built once outside timing).
    One timed forward+backward call is ``out = f(...); out.backward(grad_out)`` with a fixed
    random ``grad_out``; before each call, outside the timed region, the inputs' ``.grad``
    (and a layer's parameters') are set to ``None`` (no device work), so every timed backward
    allocates fresh gradients.
    Attention, forward and forward+backward: ``edgedot`` (:func:`edgedot.graph_attention`),
    ``edgedot_det`` (``deterministic=True``), ``edgedot_plan`` (an ``EdgePlan`` per input set,
    built outside timing), ``edgedot_layer`` (``edgedot.nn.TransformerConv(128, 32, heads=4,
    root_weight=False)``, the whole layer), ``pyg`` (``torch_geometric.nn.TransformerConv`` of
    the same configuration and weights, the whole layer; n/a without torch_geometric) and
    ``compile`` (``torch.compile(dynamic=False)`` of the unfused math: gathers of ``q[dst]``,
    ``k[src]``, ``v[src]``, scores, ``scatter_reduce`` amax per destination, ``exp``,
    scatter-added sums, ``index_add`` of the weighted values; softmax and sums in float32). The
    layers' forward runs under ``torch.no_grad()``.

Correctness
    Before a path is timed, its result on input set 0 (forward+backward: the output and the
    gradients) is compared with a float64 reference: the relative error
    ``||got - ref|| / ||ref||`` must not exceed ``TOLERANCE[dtype]``. A path that fails is
    reported as FAIL and not timed; PyG, a baseline, is timed anyway and marked ``*``.
    Attention: the reference (``edgedot.graph_attention_reference`` in float64) is computed on
    the edges into a random sample of destination nodes (all nodes up to 2**20 edges), and
    the check's backward gets a ``grad_out`` that is zero outside the sample, so that every
    gradient is checked whole (``edgedot/bench/attention_check.py``).

Timing
    Each call is timed on its own between two CUDA events (on the CPU: ``time.perf_counter``),
    and the median is reported. Warm-up is one timed pass over all input sets, discarded; its
    median sets the number of timed calls (enough for about ``target_s`` seconds, clamped to
    ``[min_reps, max_reps]``, times ``--reps-scale``). Calls rotate through several input sets
    (features, indices and ``grad_out`` drawn anew) until together they exceed twice the L2
    cache, so a small case is not timed out of the cache; a case larger than that uses one set.
    Each path of a section is timed after the one before, except in the mini-batch cases (a new
    graph every call, times bound by the host): there every path is checked and warmed up first,
    then all are timed in ``FRESH_GRAPH_ROUNDS`` rounds, each round taking every path in turn for
    its share of the calls, so that the host's drift falls on all paths alike.
    "Kernel time alone" (the ``default`` case; eager, compile, edgedot): ``CALLS_PER_GRAPH``
    forward calls are captured in one ``torch.cuda.CUDAGraph`` and the replays are timed; the
    time per call is a replay's divided by ``CALLS_PER_GRAPH``. "cold": the calls rotate
    through the input sets (larger than L2 together); "hot": every call is on input set 0, so
    its 0.9 MB of tables stay in L2.

Bytes and bandwidth
    Bytes counted are the least the op must move for its edge order. Forward: both index arrays
    (``E x index itemsize x 2``), the output (``E x H x itemsize``), one dst row per edge
    (``E x H x D x itemsize``) and the src rows: each distinct src row once when the edges are
    sorted by src, else one per edge (``E x H x D x itemsize``). Forward+backward adds the
    backward's least: both index arrays and ``grad_out`` read again, the other side's row once
    per edge for each of the two gradients (no single edge order spares both), and each
    gradient row written once (``(Ns + Nd) x H x D x itemsize``). The cuSPARSE path is counted
    by the same rule on its own edges (E_unique, sorted by src). The bandwidth fraction is
    ``bytes / median time / copy bandwidth``, where the copy bandwidth is that of
    ``dst.copy_(src)`` on a 2 GiB tensor, counting bytes read and written, median of 10 copies.
    A fraction above 1 means rows counted once per edge came from the L2 cache instead: the
    rows of one side fit in it (mid cases), a power-law graph's hot rows stay in it (rmat), or
    edgedot visited shuffled edges of wide rows grouped by row range (``mid_d1000``; see
    ``edgedot/csrc/edge_order.cu``).
    L2 bandwidth: ``CALLS_PER_GRAPH`` hot ``dst.copy_(src)`` of 8 MiB buffers replayed from one
    CUDA graph (bytes read + written; median of 20 replays), and likewise ``torch.sum`` of 8 MiB
    (bytes read). The hot graph replay counts the bytes gathered (``E x 2 rows x H x D x
    itemsize``, both indices and the output) and reports them per second as a fraction of the
    L2 copy bandwidth too.
    Attention gather bound: each edge's k and v rows and both its indices, each node's q row and
    output row, at the copy bandwidth; the forward's "time / gather bound" is its ratio.

Peak extra memory
    ``torch.cuda.max_memory_allocated()`` during one call, after ``reset_peak_memory_stats()``,
    minus the memory allocated just before it: it includes the output (and gradients).
    Out of memory is reported as OOM, and the benchmark goes on. The attention targets table
    compares edgedot with targets set for the full-size cases on an NVIDIA H200 (ok / MISS); other
    devices and ``--quick`` runs show them unscored (n/a). On the Reddit-size case the notes say
    which paths train within its 10 GB memory budget.

Statuses in place of a number: FAIL (wrong result), OOM (out of memory), n/a (the path does not
apply; the reason is printed under the tables), ERR (the path raised; the message is printed).
Results go to stdout as tables, to a JSON file (every number, including each timed call) and
to a PNG chart (if matplotlib is installed).
"""
