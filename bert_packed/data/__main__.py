"""Command line of the data pipeline: `python -m bert_packed.data {kjv,vocab,create,pack,stats}`.

User mistakes (including OSErrors: a missing folder, an unwritable path) print one line
`error: ...` to stderr and exit 2 (no traceback); Ctrl-C exits 130 leaving no partial output.
"""
import json
import os
import sys

from packing.entry import ArgumentParser, run_cli

from bert_packed.data.prepare import formats


def _add_format_options(p):
    """--format and --text-column: the input formats of `create` and `vocab` (formats.REGISTRY)."""
    p.add_argument("--format", default=None, choices=list(formats.REGISTRY),
                   help="input format of every file (default: detected per file from its name and head)")
    p.add_argument("--text-column", default=None, help="JSONL field / Parquet column of the text (default: text)")


def _parser():
    parser = ArgumentParser(prog="python -m bert_packed.data",
                                     description="Real pre-training data: text -> HDF5 -> packed HDF5.")
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("vocab", help="train a WordPiece vocabulary (vocab.txt) on a corpus")
    p.add_argument("--input", nargs="+", required=True,
                   help="corpus files, directories (recursively) or quoted globs, read as `create` reads them")
    p.add_argument("--size", type=int, required=True, help="vocabulary size (upper bound)")
    p.add_argument("--output", required=True, help="vocab.txt to write")
    p.add_argument("--cased", action="store_true", help="keep case and accents")
    p.add_argument("--min-frequency", type=int, default=2)
    _add_format_options(p)

    p = commands.add_parser("create", help="raw text -> unpacked HDF5 (Google BERT's algorithm)")
    p.add_argument("--input", nargs="+", required=True,
                   help="corpus files, directories (recursively) or quoted globs, each in one of the input "
                        f"formats ({', '.join(formats.REGISTRY)})")
    p.add_argument("--vocab", required=True, help="WordPiece vocab.txt")
    p.add_argument("--output", required=True,
                   help="a directory of HDF5 shards plus manifest.json (streams: memory bounded by a shard); "
                        "a name ending in .h5/.hdf5 writes one file (the one shard of --output-shards 1, made in "
                        "memory)")
    p.add_argument("--max-seq-length", "--max-sequence-length", dest="max_seq_length", type=int,
                   default=128)
    p.add_argument("--max-predictions", type=int, default=20, help="masked tokens per sequence, at most")
    p.add_argument("--dupe-factor", type=int, default=10, help="passes over the corpus (different masks)")
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--short-seq-prob", type=float, default=0.1)
    p.add_argument("--masked-lm-prob", type=float, default=0.15)
    p.add_argument("--whole-word-mask", action="store_true")
    p.add_argument("--cased", action="store_true", help="keep case and accents")
    _add_format_options(p)
    p.add_argument("--workers", type=int, default=None,
                   help="local worker processes (default: every core, 1 for a .h5 --output; ignored with "
                        "--scheduler)")
    p.add_argument("--scheduler", default=None, help="address of an existing Dask scheduler, e.g. tcp://host:8786")
    p.add_argument("--output-shards", type=int, default=None,
                   help="number of shards (default: one per ~4 MiB of input)")
    p.add_argument("--block-bytes", type=int, default=None,
                   help="input block size of a tokenising task (default: 8 MiB)")
    p.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="progress bars on stderr (default: when stderr is a terminal)")
    p.add_argument("--no-progress", dest="progress", action="store_false")

    p = commands.add_parser("pack", help="unpacked HDF5 -> packed HDF5 (a file, or a sharded dataset directory)")
    p.add_argument("--input", required=True,
                   help="unpacked HDF5 (NVIDIA/MLPerf layout), or a directory of unpacked shards with manifest.json")
    p.add_argument("--output", required=True,
                   help="packed HDF5 to write (a directory of packed shards when --input is a directory)")
    p.add_argument("--algorithm", default="lpfhp", help="packing algorithm (python -m packing report)")
    p.add_argument("--max-sequences-per-pack", type=int, default=3)
    p.add_argument("--max-sequence-length", type=int, default=None,
                   help="pack length (default: the input's sequence length)")
    p.add_argument("--max-masked-tokens-per-pack", type=int, default=None,
                   help="masked-token slots per pack (default: the most any pack needs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-packs", type=int, default=8192, help="packs written per chunk (memory bound)")
    p.add_argument("--compression", default="gzip", choices=["gzip", "lzf", "none"])
    p.add_argument("--workers", type=int, default=None,
                   help="sharded input: local worker processes (default: every core; 1 = this process)")
    p.add_argument("--scheduler", default=None,
                   help="sharded input: address of an existing Dask scheduler (its workers do the shards; "
                        "--workers is ignored)")
    p.add_argument("--verify", action="store_true",
                   help="afterwards, check that every input sequence is in the output exactly once (digests)")
    p.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="progress bars on stderr (default: when stderr is a terminal)")
    p.add_argument("--no-progress", dest="progress", action="store_false")

    p = commands.add_parser("stats", help="length histogram and padding of an HDF5 file or a sharded dataset")
    p.add_argument("file", help="unpacked or packed HDF5 file, or a dataset directory (shards and manifest.json)")
    p.add_argument("--plot", default=None, help="PNG to write (default: FILE with .png)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--json", action="store_true", help="print the statistics as JSON")

    p = commands.add_parser("kjv", help="write the King James Bible (Debian bible-kjv) as a corpus")
    p.add_argument("--output", required=True)
    p.add_argument("--first", default="Gen1:1")
    p.add_argument("--last", default="Rev22:21")
    return parser


def main(argv=None):
    args = _parser().parse_args(argv)
    # Outputs are written through temporary files that are removed on the way out, so an
    # interrupted step leaves the previous outputs as they were.
    interrupted = "interrupted: nothing was written"
    if args.command == "create" and _sharded(args.output):
        interrupted = ("interrupted: finished blocks and shards are kept in " + args.output
                       + "; run the same command again to finish")
    return run_cli(lambda: _run(args), interrupted=interrupted)


def _check_size_flags(args):
    """Every size flag within its maximum (bert_packed.limits.DATA_FLAGS, with the reasons)."""
    from bert_packed.limits import size_flag_error
    from bert_packed.data.errors import DataError
    message = size_flag_error(args.command, vars(args))
    if message is not None:
        raise DataError(message)


def _sharded(output):
    """`create --output`: a directory of shards unless the name ends in .h5/.hdf5."""
    return not output.lower().endswith((".h5", ".hdf5"))


def _run(args):
    _check_size_flags(args)
    if args.command == "vocab":
        from bert_packed.data.prepare.vocab import train_vocab
        num_tokens = train_vocab(args.input, args.size, args.output, lowercase=not args.cased,
                                 min_frequency=args.min_frequency, input_format=args.format,
                                 text_column=_text_column(args))
        print(f"wrote {args.output}: {num_tokens} tokens")
    elif args.command == "create" and _sharded(args.output):
        _create_shards(args)
    elif args.command == "create":
        _create_file(args)
    elif args.command == "pack" and os.path.isdir(args.input):
        _pack_dataset(args)
    elif args.command == "pack":
        from bert_packed.data.prepare.pack import pack_file
        if args.workers is not None or args.scheduler is not None:
            from bert_packed.data.errors import DataError
            raise DataError(f"--workers and --scheduler are for a sharded dataset (a directory); {args.input} is "
                            "one file, packed in this process")
        stats = pack_file(args.input, args.output, algorithm=args.algorithm,
                          max_sequences_per_pack=args.max_sequences_per_pack,
                          max_sequence_length=args.max_sequence_length,
                          max_masked_tokens_per_pack=args.max_masked_tokens_per_pack,
                          seed=args.seed, chunk_packs=args.chunk_packs,
                          compression=args.compression,
                          show_progress=sys.stderr.isatty() if args.progress is None else args.progress)
        print(f"wrote {args.output}: {stats['num_sequences']} sequences in {stats['num_packs']} "
              f"packs ({stats['algorithm']}, depth <= {stats['max_sequences_per_pack']}), "
              f"packing factor {stats['packing_factor']:.3f}, efficiency "
              f"{100 * stats['efficiency']:.2f} % (unpacked {100 * stats['unpacked_efficiency']:.2f} %), "
              f"speed-up {stats['speedup']:.3f}x"
              + (f"; LP bound {stats['lp_bound_packs']} packs" if stats.get("lp_bound_packs") else ""))
        if args.verify:
            _verify_file(args.input, args.output)
    elif args.command == "stats":
        from bert_packed.data.errors import refuse_output_over_input
        from bert_packed.data.stats import dataset_stats, format_stats, plot_stats
        if not args.no_plot:  # checked before reading: the PNG must never replace the data it plots
            refuse_output_over_input(args.plot or _with_suffix(args.file, ".png"), [args.file], option="--plot")
        _refuse_a_corpus(args.file)
        stats = dataset_stats(args.file)
        print(json.dumps(stats, indent=1) if args.json else format_stats(stats))
        if not args.no_plot:
            path = args.plot or _with_suffix(args.file, ".png")
            plot_stats(stats, path)
            print(f"plot: {path}", file=sys.stderr)
    elif args.command == "kjv":
        from bert_packed.data.prepare.kjv import write_kjv_corpus
        num_documents, num_verses = write_kjv_corpus(args.output, args.first, args.last)
        print(f"wrote {args.output}: {num_documents} chapters (documents), {num_verses} verses")
    return 0


def _text_column(args):
    return "text" if args.text_column is None else args.text_column


def _create_file(args):
    """`create` into one .h5 file: the sharded engine writing one shard (create_file.py)."""
    if args.output_shards not in (None, 1):
        from bert_packed.data.errors import DataError
        raise DataError(f"--output-shards {args.output_shards}: --output {args.output} (.h5) is one file, one shard; "
                        f"give a directory for {args.output_shards} shards")
    from bert_packed.data.prepare.create_file import create_pretraining_file
    summary = create_pretraining_file(
        args.input, args.vocab, args.output, max_seq_length=args.max_seq_length,
        max_predictions=args.max_predictions, dupe_factor=args.dupe_factor,
        seed=args.seed, short_seq_prob=args.short_seq_prob,
        masked_lm_prob=args.masked_lm_prob, lowercase=not args.cased,
        whole_word_mask=args.whole_word_mask, input_format=args.format, text_column=_text_column(args),
        workers=1 if args.workers is None else args.workers, scheduler=args.scheduler,
        **({} if args.block_bytes is None else {"block_bytes": args.block_bytes}),
        show_progress=sys.stderr.isatty() if args.progress is None else args.progress)
    print(f"wrote {args.output}: {summary['num_sequences']} sequences from "
          f"{summary['num_documents']} documents, {summary['num_tokens']} tokens, "
          f"{summary['num_masked_tokens']} masked, random next "
          f"{100 * summary['random_next_fraction']:.1f} %, padding "
          f"{100 * summary['padding_fraction']:.1f} %")


def _create_shards(args):
    from bert_packed.data.prepare.create_shards import DEFAULT_BLOCK_BYTES, create_shards
    summary = create_shards(
        args.input, args.vocab, args.output, max_seq_length=args.max_seq_length,
        max_predictions=args.max_predictions, dupe_factor=args.dupe_factor, seed=args.seed,
        short_seq_prob=args.short_seq_prob, masked_lm_prob=args.masked_lm_prob, lowercase=not args.cased,
        whole_word_mask=args.whole_word_mask, input_format=args.format, text_column=_text_column(args),
        workers=args.workers, scheduler=args.scheduler, output_shards=args.output_shards,
        block_bytes=DEFAULT_BLOCK_BYTES if args.block_bytes is None else args.block_bytes,
        show_progress=sys.stderr.isatty() if args.progress is None else args.progress)
    print(f"wrote {args.output}: {summary['num_sequences']} sequences in {summary['num_shards']} shards from "
          f"{summary['num_documents']} documents, {summary['num_tokens']} tokens, "
          f"{summary['num_masked_tokens']} masked, random next {100 * summary['random_next_fraction']:.1f} %, "
          f"padding {100 * summary['padding_fraction']:.1f} %")


def _pack_dataset(args):
    """`pack` of a directory of shards (bert_packed.data.prepare.pack_shards) and its summary line."""
    from bert_packed.data.prepare.pack_shards import pack_dataset
    manifest = pack_dataset(args.input, args.output, algorithm=args.algorithm,
                            max_sequences_per_pack=args.max_sequences_per_pack,
                            max_sequence_length=args.max_sequence_length,
                            max_masked_tokens_per_pack=args.max_masked_tokens_per_pack,
                            seed=args.seed, chunk_packs=args.chunk_packs, compression=args.compression,
                            workers=args.workers, scheduler=args.scheduler, verify=args.verify,
                            show_progress=sys.stderr.isatty() if args.progress is None else args.progress)
    bound = manifest["lp_bound_packs"]
    print(f"wrote {args.output}: {manifest['num_sequences']} sequences in {manifest['num_packs']} packs over "
          f"{manifest['num_shards']} shards ({manifest['algorithm']}, depth <= "
          f"{manifest['max_sequences_per_pack']}), packing factor {manifest['packing_factor']:.3f}, efficiency "
          f"{100 * manifest['efficiency']:.2f} % (unpacked {100 * manifest['unpacked_efficiency']:.2f} %); "
          f"LP bound {bound} packs, gap {manifest['gap_percent']:.4f} %; unsharded plan "
          f"{manifest['unsharded_packs']} packs, sharding gap {manifest['sharding_gap_percent']:.4f} %")
    if args.verify:  # checked shard by shard before the manifest was written (pack_shards.pack_shard)
        print(f"verified: {manifest['verified_sequences']} sequences, each exactly once")


def _verify_file(input_path, output_path):
    """`pack --verify` of one file: a file that fails is removed, so it never looks finished."""
    from bert_packed.data.errors import DataError
    from bert_packed.data.prepare.pack import verify_packed_file
    try:
        count = verify_packed_file(input_path, output_path)
    except DataError as exc:
        os.unlink(output_path)
        raise DataError(f"{exc}; {output_path} was removed") from None
    print(f"verified: {count} sequences, each exactly once")


def _with_suffix(path, suffix):
    root, _ = os.path.splitext(os.path.normpath(path))  # a directory "out/" plots to out.png
    return root + suffix


def _refuse_a_corpus(path):
    """A corpus (create's input), a pipe or a device given to stats is named as what it is, not as a
    broken HDF5 file."""
    from bert_packed.data.errors import DataError

    kind = formats.base.not_regular_kind(path)
    if kind is not None:
        raise DataError(f"{path}: is {kind}, not a regular file; stats reads an HDF5 file or a dataset directory")
    if not os.path.isfile(path):
        return
    with open(path, "rb") as handle:
        if handle.read(8) == b"\x89HDF\r\n\x1a\n":
            return
    fmt = formats.detect_format(path)
    if not formats.REGISTRY[fmt].fallback:  # plain text falls through to h5io's "not a readable HDF5 file"
        raise DataError(f"{path}: a {fmt} corpus (the input of `create`), not HDF5; stats reads what `create` "
                        f"and `pack` write: an HDF5 file or a dataset directory")


if __name__ == "__main__":
    sys.exit(main())

