#!/usr/bin/env bash
# The kernels a lent GPU machine compiled, kept from one lease to the next. A bare machine compiles every Triton
# kernel it launches in every autotune config it times (the attention split kernel's up to 12, the GEMV's 10 a
# matrix shape; one split config took 14 s to compile for sm_90 on the 2-core VM) and, for `--compare`'s baseline,
# every kernel torch.compile generates: device time each lease spends again on the same kernels.
#
#     source bench/gpu_cache.sh && compiled_restore   # gpu.sh, before anything compiles
#     bash bench/gpu_cache.sh save FILE               # after a lease's runs: what it compiled, into FILE
#
# restore points Triton's and TorchInductor's caches at one folder (where neither TRITON_CACHE_DIR nor
# TORCHINDUCTOR_CACHE_DIR is set already) and, once a machine, unpacks there the cache a call carried as
# .gpu-cache/compiled.tgz. save packs that folder without the intermediate IR (PTX, LLVM and Triton IR: a cached
# kernel loads from its cubin) into FILE, if it fits in 11 MiB (a call carries 64, half the embedded model 47),
# else Triton's part alone, else as many of Triton's kernels as fit, the first compiled first;
# bench/gpu_lease.sh saves it as $OUT/compiled.tgz, which the session keeps here as .gpu-cache/compiled.tgz (git
# ignores it) and carries on the next lease. The folder's path is the same on every machine, because Triton's
# cache records its files' absolute paths; its keys hold Triton's version, ptxas's, the target (sm_90 for the H100
# and the H200 alike) and each kernel's source, so an entry made stale by a change is never used, only carried.
# Autotuning's choices are not kept (Triton keys them by the target, not the card): each lease times its own.

COMPILED_DIR=${COMPILED_DIR:-/tmp/llmrun-compiled}
COMPILED_IR=('*.ptx' '*.llir' '*.ttir' '*.ttgir' '*.source')
COMPILED_LIMIT=${COMPILED_LIMIT:-$((11 * 1024 * 1024))}  # beside half the model (47 MiB) in a call's 64

compiled_restore() {
    if [ "${TRITON_CACHE_DIR:-$COMPILED_DIR/triton}" != "$COMPILED_DIR/triton" ] \
            || [ "${TORCHINDUCTOR_CACHE_DIR:-$COMPILED_DIR/inductor}" != "$COMPILED_DIR/inductor" ]; then
        echo "gpu_cache: TRITON_CACHE_DIR or TORCHINDUCTOR_CACHE_DIR is set: compiling into those" >&2
        return 0
    fi
    export TRITON_CACHE_DIR=$COMPILED_DIR/triton TORCHINDUCTOR_CACHE_DIR=$COMPILED_DIR/inductor
    mkdir -p "$TRITON_CACHE_DIR" "$TORCHINDUCTOR_CACHE_DIR"
    if [ -f .gpu-cache/compiled.tgz ] && [ ! -e "$COMPILED_DIR/.restored" ]; then
        if tar xzf .gpu-cache/compiled.tgz -C "$COMPILED_DIR"; then
            echo "gpu_cache: $(find "$COMPILED_DIR" -type f | wc -l) compiled files restored from" \
                ".gpu-cache/compiled.tgz" >&2
        else
            echo "gpu_cache: .gpu-cache/compiled.tgz did not unpack; compiling from scratch" >&2
        fi
        touch "$COMPILED_DIR/.restored"  # a warm machine's next call keeps what the calls before added
    fi
}

compiled_save() {  # compiled_save FILE: the cache folder, IR left out, into FILE; none if it would not come back
    local out excludes=() pattern parts part present
    out=$(realpath -m "$1")
    for pattern in "${COMPILED_IR[@]}"; do excludes+=(--exclude="$pattern"); done
    for parts in "triton inductor" "triton"; do  # Triton's kernels first: every run of the lease compiles them
        present=()
        for part in $parts; do [ ! -d "$COMPILED_DIR/$part" ] || present+=("$part"); done
        if [ ${#present[@]} = 0 ]; then
            echo "gpu_cache: nothing compiled into $COMPILED_DIR" >&2
            return 0
        fi
        tar czf "$out" -C "$COMPILED_DIR" "${excludes[@]}" "${present[@]}"
        if [ "$(stat -c %s "$out")" -le "$COMPILED_LIMIT" ]; then
            echo "gpu_cache: ${present[*]} saved into $out ($(( $(stat -c %s "$out") / 1024 )) KiB)" >&2
            return 0
        fi
    done
    # Triton's alone too big (the second H100 lease's were): its kernels, a folder each (a compiled config or a
    # launcher), the first compiled first, as many as fit: each one a lease restores is a compile it skips. How many,
    # first from their sizes at the whole's rate of compression (one more pack, not one a guess), then fewer if need be
    local dirs=() kept=0 d packed whole total=0
    mapfile -t dirs < <(cd "$COMPILED_DIR" && ls -d -tr triton/*/ 2>/dev/null)
    packed=$(stat -c %s "$out")
    whole=$(du -sb "$COMPILED_DIR/triton" | cut -f1)
    for d in "${dirs[@]}"; do
        total=$((total + $(du -sb "$COMPILED_DIR/$d" | cut -f1)))
        [ $((total * packed / whole)) -le $((COMPILED_LIMIT * 9 / 10)) ] || break
        kept=$((kept + 1))
    done
    [ "$kept" -gt 0 ] || kept=1
    while [ ${#dirs[@]} -gt 0 ]; do
        tar czf "$out" -C "$COMPILED_DIR" "${excludes[@]}" "${dirs[@]:0:kept}"
        if [ "$(stat -c %s "$out")" -le "$COMPILED_LIMIT" ]; then
            echo "gpu_cache: the first $kept of ${#dirs[@]} Triton kernels compiled saved into $out" \
                "($(( $(stat -c %s "$out") / 1024 )) KiB; all of them exceed $((COMPILED_LIMIT >> 20)) MiB)" >&2
            return 0
        fi
        [ "$kept" -gt 1 ] || break
        kept=$((kept * 3 / 4))
    done
    rm -f "$out"
    echo "gpu_cache: Triton's compiled kernels exceed $((COMPILED_LIMIT >> 20)) MiB, even the first alone" \
        "(or none is in a folder of its own); not saved" >&2
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    case ${1:-} in
        save) [ $# = 2 ] || { echo "usage: bash bench/gpu_cache.sh save FILE" >&2; exit 2; }; compiled_save "$2" ;;
        *) echo "usage: bash bench/gpu_cache.sh save FILE (or source it and call compiled_restore)" >&2; exit 2 ;;
    esac
fi
