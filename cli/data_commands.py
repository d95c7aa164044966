"""``pfuse import-data`` and ``pfuse partition``."""

from __future__ import annotations

import click

from posterior_fusion import ranges
from posterior_fusion.choices import PROTOCOLS
from posterior_fusion.cli.common import bounded, echo_json, handle_errors, max_memory_option, old_spellings, say
from posterior_fusion.data.importers import FORMATS
from posterior_fusion.data.prepare import DATASETS, SCHEMES, import_data, partition_to_files
from posterior_fusion.data.silo import MAX_CLASSES
from posterior_fusion.errors import ConfigError


@click.command("import-data")
@click.argument("source")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Output data file (HDF5, docs/data-format.md).")
@click.option("--format", "fmt", default="auto", show_default=True, type=click.Choice(("auto", *FORMATS)),
              help="Source format [auto: from the name; sklearn:NAME for scikit-learn's bundled data sets].")
@click.option("--transform", default="auto", show_default=True,
              help="Input transform shared by the federation: auto (per-channel/feature mean and std of this "
                   "data), none, constants:NAME (fmnist, mnist, cifar10, svhn) or from:FILE (another data file's).")
@click.option("--labels", "labels_path", default=None, type=click.Path(dir_okay=False),
              help="Labels file for npy and idx sources [default: unlabelled for npy; none for idx].")
@click.option("--label-column", default="label", show_default=True, help="CSV column holding the labels.")
@click.option("--x-key", default="x", show_default=True, help="Array/dataset name of the inputs (npz, hdf5).")
@click.option("--y-key", default="y", show_default=True, help="Array/dataset name of the labels (npz, hdf5).")
@click.option("--image-size", default=None, help="Resize images of an image folder to WxH, e.g. 32x32 [default: first image's size].")
@click.option("--grey/--rgb", default=None,
              help="Read images of an image folder as grey levels (one channel) or RGB [default: grey when every "
                   "image is stored with one channel].")
@click.option("--name", default=None, help="Data set name recorded in the file [default: the source's name].")
@click.option("--num-classes", default=None, type=bounded((1, MAX_CLASSES)), help="Number of classes [default: largest label + 1].")
@click.option("--follow-links", is_flag=True,
              help="Read symbolic links that leave an image or CIFAR folder [default: refuse them].")
@max_memory_option
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@handle_errors
def import_data_cmd(source, out, fmt, transform, labels_path, label_column, x_key, y_key, image_size, grey, name,
                    num_classes, follow_links, max_memory, as_json):
    """Convert a data set (npz/npy, CSV, image folder, HDF5 x/y, CIFAR-10 binary, SVHN .mat, IDX,
    sklearn:digits|breast_cancer|wine) into a posterior-fusion data file."""
    size = None
    if image_size:
        try:
            w, h = (int(v) for v in image_size.lower().split("x"))
            size = (w, h)
        except ValueError:
            raise ConfigError(f"--image-size takes WxH, e.g. 32x32, got {image_size!r}") from None
    summary = import_data(source, out, fmt, transform, name, num_classes, labels=labels_path, label_column=label_column,
                          x_key=x_key, y_key=y_key, size=size, grey=grey, max_memory=max_memory,
                          follow_links=follow_links)
    if as_json:
        echo_json(summary)
        return
    say(f"wrote {out}: {summary['n']} samples of shape {tuple(summary['input_shape'])} ({summary['dtype']}), "
               f"{summary['num_classes']} classes, labels {'yes' if summary['labels'] else 'no'}; "
               f"transform {summary['transform']['source']}")


@click.command("partition")
@click.option("--data", "source", default=None, type=click.Path(dir_okay=False),
              help="An imported, labelled data file to split [default: the built-in --dataset].")
@click.option("--test", "test_path", default=None, type=click.Path(dir_okay=False),
              help="With --data: the test data file, copied to test.h5 with the federation's transform [default: none].")
@click.option("--test-size", default=0, show_default=True, type=bounded((0, ranges.N_DATA[1])),
              help="With --data and no --test: hold out this many samples as test.h5 (disjoint from all others).")
@click.option("--dataset", default="fmnist", show_default=True, type=click.Choice(DATASETS), help="Built-in data set to split.")
@click.option("--clients", default=5, show_default=True, type=bounded(ranges.CLIENTS), help="Number of client silos C.")
@click.option("--alpha", default=0.1, show_default=True, type=bounded(ranges.ALPHA, float), help="Dirichlet concentration α (smaller = more non-IID).")
@click.option("--partition-seed", default=0, show_default=True, type=bounded(ranges.SEED),
              help="Seed of the split (separate from init and training seeds).")
@click.option("--out-dir", required=True, type=click.Path(file_okay=False), help="Folder for client_<i>.h5, server_val.h5, test.h5.")
@click.option("--val-size", default=500, show_default=True, type=bounded((0, ranges.N_DATA[1])), help="Server validation samples, disjoint from all clients.")
@click.option("--unlabeled-size", default=0, show_default=True, type=bounded((0, ranges.N_DATA[1])),
              help="Also hold out this many training samples, without labels, as server_unlabeled.h5 (disjoint from "
                   "all others): the unlabeled server data of fuse --unlabeled (FedBE, FedPPD, --distill).")
@click.option("--min-size", default=10, show_default=True, type=bounded((0, ranges.N_DATA[1])), help="Redraw until every client has at least this many samples.")
@click.option("--scheme", default="fedbens", show_default=True, type=click.Choice(SCHEMES),
              help="fedbens: client-wise Dir(α·1_K) class proportions; per-class: Dir(α·1_C) over clients per class; "
                   "label-skew: at most --classes-per-client classes per client.")
@click.option("--classes-per-client", default=None, type=bounded((1, MAX_CLASSES)), help="Classes per client of --scheme label-skew.")
@click.option("--protocol", default="ours", show_default=True, type=click.Choice(PROTOCOLS),
              help="ours: independent split per --partition-seed, disjoint validation; fedbens-reference: the "
                   "FedBEns authors' split (NumPy seed 3, validation drawn with replacement from all training "
                   "data, MNIST normalisation; train with --epochs 30 as their scripts do).")
@click.option("--data-dir", default=None, type=click.Path(file_okay=False),
              help="Folder with the Fashion-MNIST IDX .gz files [default: /usr/share/datasets/fashion-mnist, else the embedded subset].")
@click.option("--max-train", default=None, type=bounded(ranges.N_DATA), help="Use at most this many training samples [default: all].")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@old_spellings("partition")
@handle_errors
def partition(source, test_path, test_size, dataset, clients, alpha, partition_seed, out_dir, val_size, unlabeled_size,
              min_size, scheme, classes_per_client, protocol, data_dir, max_train, as_json):
    """Split a data set into non-IID client silos plus server validation and test files."""
    summary = partition_to_files(out_dir, dataset, clients, alpha, partition_seed, val_size, min_size, scheme,
                                 data_dir, max_train, source, test_path, classes_per_client, test_size, protocol,
                                 unlabeled_size)
    if as_json:
        echo_json(summary)
        return
    shape = f"classes_per_client={classes_per_client}" if scheme == "label-skew" else f"alpha={alpha}"
    say(f"source: {summary['source']}  {shape} partition_seed={partition_seed} scheme={scheme}")
    for i, c in enumerate(summary["clients"]):
        say(f"client_{i}: n={c['n']:6d}  class counts {c['class_counts']}")
    say(f"server_val: {summary['server_val'] or 'none (--val-size 0)'}\ntest: {summary['test']}")
    if summary.get("server_unlabeled"):
        say(f"server_unlabeled: {summary['server_unlabeled']} ({unlabeled_size} samples, no labels)")
