// wg_sum / wg_max / wg_prod of shaders/reduce.wgsl with subgroup operations (wgpu
// SUBGROUP): one subgroupAdd / subgroupMax / subgroupMul per subgroup, then every
// invocation folds the WG / size partials from workgroup memory in subgroup order, so the
// order of the operations is fixed and reruns are bit-identical. One barrier pair instead of log2(WG) steps.
//
// WGSL promises no relation between subgroups and local_invocation_index; the host uses
// this variant only after a probe (device.rs) showed the adapter forms full subgroups of
// consecutive indices (lid / size is the subgroup), as Vulkan drivers do for compute.
// The size is counted rather than taken from @builtin(subgroup_size), which only entry
// points may declare. Callers are in uniform control flow (the barriers need it too).

fn wg_sum(v: f32, lid: u32) -> f32 {
    let size = subgroupAdd(1u);
    let p = subgroupAdd(v);
    if (lid % size == 0u) { red[lid / size] = p; }
    workgroupBarrier();
    var r = red[0];
    for (var k = 1u; k < WG / size; k += 1u) { r += red[k]; }
    workgroupBarrier();
    return r;
}

// subgroupMax follows SPIR-V FMax, which may drop a NaN operand: a NaN anywhere in the
// subgroup is carried by hand, so max keeps propagating NaN as nan_max does.
fn wg_max(v: f32, lid: u32) -> f32 {
    let size = subgroupAdd(1u);
    let p = select(subgroupMax(v), bitcast<f32>(0x7fc00000u), subgroupAny(is_nan(v)));
    if (lid % size == 0u) { red[lid / size] = p; }
    workgroupBarrier();
    var r = red[0];
    for (var k = 1u; k < WG / size; k += 1u) { r = nan_max(r, red[k]); }
    workgroupBarrier();
    return r;
}

fn wg_prod(v: f32, lid: u32) -> f32 {
    let size = subgroupAdd(1u);
    let p = subgroupMul(v);
    if (lid % size == 0u) { red[lid / size] = p; }
    workgroupBarrier();
    var r = red[0];
    for (var k = 1u; k < WG / size; k += 1u) { r *= red[k]; }
    workgroupBarrier();
    return r;
}
