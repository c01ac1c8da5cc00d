//! [`MatmulKernel`]: which of cubek's matrix-product routines runs the frozen base's products on
//! a GPU (`TROUPE_MATMUL`), to measure them against one another and against cuBLAS.
//!
//! Every frozen projection (q/k/v, o, gate/up, down, the LM head; forward and the input's
//! gradient `dy W`) is one product ([`super::fused::gpu::frozen_linear`]). Without burn's
//! autotune (off in troupe: it times candidates at every new shape, inside the iteration) burn
//! runs one routine by rule, cubek's simple cyclic routine on the tile-matrix units, falling
//! back to a routine without them where they do not take the operands' types (`auto`). cubek
//! has others, double-buffered, specialised (loading planes apart from computing ones), on the
//! Hopper tensor-memory accelerator (TMA); autotune picks among them by timing. Naming one here
//! runs it for every frozen product, so one binary compares them on one GPU
//! (`benches/gemm.rs`'s `frozen` group, `tools/gpu_figures.py --gemm`). A routine that cannot
//! launch a product on the device (its units absent, a shape its tiles refuse) leaves that
//! product to `auto`, with one warning per routine and reason.
//!
//! The names are troupe's; [`MatmulKernel::cubek`] says which cubek strategy each is.

/// `TROUPE_MATMUL`: the routine of the frozen products on a GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum MatmulKernel {
    /// burn's rule without autotune: `simple-cmma`, or `simple-unit` where the tile-matrix
    /// units do not take the operands.
    #[default]
    Auto,
    /// The simple cyclic routine on CMMA (warp-level matrix) tiles.
    SimpleCmma,
    /// The simple cyclic routine on PTX `mma` tiles.
    SimpleMma,
    /// `simple-cmma`, several rows of tiles a plane.
    SimpleMultirowCmma,
    /// `simple-mma`, several rows of tiles a plane.
    SimpleMultirowMma,
    /// Double-buffered: the next stage loads while this one multiplies.
    DoubleCmma,
    /// `double-cmma` on `mma` tiles.
    DoubleMma,
    /// `double-cmma` with loading planes apart from computing ones.
    DoubleSpecializedCmma,
    /// `double-specialized-cmma` on `mma` tiles.
    DoubleSpecializedMma,
    /// Double-buffered in an order along k (2 partitions, 4 rows, 2 a plane), as autotune tries it.
    OrderedDoubleCmma,
    /// `ordered-double-cmma` on `mma` tiles.
    OrderedDoubleMma,
    /// `ordered-double-cmma` with 8 rows.
    OrderedDouble8Cmma,
    /// `ordered-double8-cmma` on `mma` tiles.
    OrderedDouble8Mma,
    /// The specialised routine with cyclic loading.
    SpecializedCmma,
    /// `specialized-cmma` on `mma` tiles.
    SpecializedMma,
    /// The simple routine loading through the tensor-memory accelerator (Hopper and later).
    SimpleTmaCmma,
    /// `simple-tma-cmma` on `mma` tiles.
    SimpleTmaMma,
    /// The specialised routine loading through the tensor-memory accelerator.
    SpecializedTmaCmma,
    /// `specialized-tma-cmma` on `mma` tiles.
    SpecializedTmaMma,
    /// One unit a tile, no tile-matrix units (burn's fallback), the largest tiles.
    SimpleUnit,
    /// `simple-unit`, double-buffered.
    DoubleUnit,
}

impl MatmulKernel {
    /// The name as `TROUPE_MATMUL` takes it.
    pub fn name(self) -> String {
        <Self as clap::ValueEnum>::to_possible_value(&self).expect("every kernel has a name").get_name().to_string()
    }

    /// Every kernel, `auto` first.
    pub fn all() -> &'static [MatmulKernel] {
        <Self as clap::ValueEnum>::value_variants()
    }
}

#[cfg(any(feature = "cuda", feature = "wgpu"))]
mod strategy {
    use cubek::matmul::multi_level::components::tile::TileMatmulKind;
    use cubek::matmul::multi_level::routines::batch::double_buffering::DoubleBufferingArgs;
    use cubek::matmul::multi_level::routines::batch::double_unit::DoubleUnitSelectionArgs;
    use cubek::matmul::multi_level::routines::batch::ordered_double_buffering::OrderedSelectionArgs;
    use cubek::matmul::multi_level::routines::batch::simple::SimpleArgs;
    use cubek::matmul::multi_level::routines::batch::simple_unit::SimpleUnitSelectionArgs;
    use cubek::matmul::multi_level::routines::TileSizeSelection;
    use cubek::matmul::multi_level::Strategy as Level;
    use cubek::matmul::routine::BlueprintStrategy::Inferred;
    use cubek::matmul::strategy::Strategy;

    use super::MatmulKernel;

    impl MatmulKernel {
        /// The cubek strategy the kernel names, with the arguments burn's autotune gives it;
        /// `auto` is cubek's own rule.
        pub fn cubek(self) -> Strategy {
            use MatmulKernel as K;
            use TileMatmulKind::{Cmma, Mma};
            let simple = |tile_matmul, multi_rows| SimpleArgs { tile_matmul, multi_rows };
            let double = |tile_matmul, specialized| DoubleBufferingArgs { tile_matmul, specialized };
            let ordered = |tile_matmul, row_count| OrderedSelectionArgs {
                tile_matmul,
                partition_k: Some(2),
                row_count: Some(row_count),
                rows_per_plane: Some(2),
            };
            let level = match self {
                K::Auto => return Strategy::Auto,
                K::SimpleCmma => Level::SimpleCyclicCmma(Inferred(simple(Cmma, false))),
                K::SimpleMma => Level::SimpleCyclicMma(Inferred(simple(Mma, false))),
                K::SimpleMultirowCmma => Level::SimpleCyclicCmma(Inferred(simple(Cmma, true))),
                K::SimpleMultirowMma => Level::SimpleCyclicMma(Inferred(simple(Mma, true))),
                K::DoubleCmma => Level::DoubleCyclicCmma(Inferred(double(Cmma, false))),
                K::DoubleMma => Level::DoubleCyclicMma(Inferred(double(Mma, false))),
                K::DoubleSpecializedCmma => Level::DoubleCyclicCmma(Inferred(double(Cmma, true))),
                K::DoubleSpecializedMma => Level::DoubleCyclicMma(Inferred(double(Mma, true))),
                K::OrderedDoubleCmma => Level::OrderedDoubleCmma(Inferred(ordered(Cmma, 4))),
                K::OrderedDoubleMma => Level::OrderedDoubleMma(Inferred(ordered(Mma, 4))),
                K::OrderedDouble8Cmma => Level::OrderedDoubleCmma(Inferred(ordered(Cmma, 8))),
                K::OrderedDouble8Mma => Level::OrderedDoubleMma(Inferred(ordered(Mma, 8))),
                K::SpecializedCmma => Level::SpecializedCyclicCmma(Inferred(().into())),
                K::SpecializedMma => Level::SpecializedCyclicMma(Inferred(().into())),
                K::SimpleTmaCmma => Level::SimpleTmaCmma(Inferred(simple(Cmma, false))),
                K::SimpleTmaMma => Level::SimpleTmaMma(Inferred(simple(Mma, false))),
                K::SpecializedTmaCmma => Level::SpecializedTmaCmma(Inferred(().into())),
                K::SpecializedTmaMma => Level::SpecializedTmaMma(Inferred(().into())),
                K::SimpleUnit => {
                    Level::SimpleUnit(Inferred(SimpleUnitSelectionArgs { tile_size: TileSizeSelection::MaxTileSize }))
                }
                K::DoubleUnit => {
                    Level::DoubleUnit(Inferred(DoubleUnitSelectionArgs { tile_size: TileSizeSelection::MaxTileSize }))
                }
            };
            Strategy::MultiLevel(level)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_has_a_distinct_name_that_parses_back() {
        let names: Vec<String> = MatmulKernel::all().iter().map(|k| k.name()).collect();
        assert_eq!(names[0], "auto");
        assert_eq!(MatmulKernel::default(), MatmulKernel::Auto);
        for (kernel, name) in MatmulKernel::all().iter().zip(&names) {
            assert_eq!(<MatmulKernel as clap::ValueEnum>::from_str(name, true), Ok(*kernel));
            assert_eq!(names.iter().filter(|n| *n == name).count(), 1, "{name} is named twice");
        }
        assert!(names.contains(&"ordered-double8-cmma".to_string()), "{names:?}");
        assert!(names.contains(&"specialized-tma-mma".to_string()), "{names:?}");
    }
}
