"""Data sources, columns and labels, on local files: the same code paths that hub datasets and user files take."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace

import pytest
from transformers import AutoConfig, AutoTokenizer

from app.config import TrainConfig
from app.errors import UsageError
from app.inputs import data, hub
from app.tasks import classification
from tests.conftest import run_app


def test_dataset_name_loads_a_local_folder_through_load_dataset(tmp_path, tiny_model_dir, review_files, capfd):
    folder = tmp_path / "my_dataset"
    folder.mkdir()
    shutil.copy(review_files["train"], folder / "train.csv")
    shutil.copy(review_files["validation"], folder / "validation.csv")
    code = run_app(
        [
            "--model_name_or_path",
            tiny_model_dir,
            "--dataset_name",
            folder,
            "--output_dir",
            tmp_path / "out",
            "--logdir",
            tmp_path / "runs",
            "--max_steps",
            "2",
            "--eval_steps",
            "0",
            "--disable_tqdm",
            "--max_length",
            "64",
        ]
    )
    assert code == 0, capfd.readouterr().err
    saved = AutoConfig.from_pretrained(tmp_path / "out")
    assert saved.id2label == {0: "great", 1: "other"} and saved.label2id == {"great": 0, "other": 1}


@pytest.mark.parametrize("split", ["validation", "test", None])
def test_a_share_held_out_beside_validation_data_of_its_own_is_refused(tmp_path, split):
    # --validation_split_percentage 20 went unused without a word beside a dataset's validation or test split, or the
    # embedded reviews' held-out ones, and training_args.yaml recorded it as if it had held 20% out.
    from datasets import Dataset, DatasetDict

    rows = {"text": [f"review {i}" for i in range(40)], "label": ["great", "other"] * 20}
    eight = {"text": [f"held {i}" for i in range(8)], "label": ["great", "other"] * 4}
    if split is None:
        cfg = TrainConfig()
        said = "the embedded reviews come with 1,000 held out"
    else:
        DatasetDict({"train": Dataset.from_dict(rows), split: Dataset.from_dict(eight)}).save_to_disk(tmp_path / "d")
        cfg = TrainConfig(dataset_name=str(tmp_path / "d"))
        said = f"--dataset_name {tmp_path / 'd'} has a {split} split"
        assert data.load_raw(cfg)["validation"]["text"][0] == "held 0"
    with pytest.raises(UsageError) as refused:
        data.load_raw(replace(cfg, validation_split_percentage=20))
    assert str(refused.value) == (
        f"{said}, the validation data, so --validation_split_percentage holds nothing out; drop it"
    )


def test_jsonl_with_int_labels_text_pairs_and_a_held_out_split(tmp_path, tiny_model_dir):
    rows = [{"premise": f"sentence {i}", "hypothesis": f"other {i % 3}", "target": i % 3} for i in range(40)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = replace(
        TrainConfig(),
        train_file=str(path),
        text_column="premise",
        text_pair_column="hypothesis",
        label_column="target",
        validation_split_percentage=25,
    )
    raw = data.load_raw(cfg)
    assert (len(raw["train"]), len(raw["validation"])) == (30, 10)
    columns = classification.resolve_columns(cfg)
    classification.check_columns(raw, columns)
    labels = classification.infer_labels(raw, "target", fixed=None)
    assert labels.id2label == {0: "0", 1: "1", 2: "2"} and not labels.string_labels


def test_string_labels_are_sorted_into_ids_and_unknown_validation_labels_fail():
    from datasets import Dataset, DatasetDict

    raw = DatasetDict(
        train=Dataset.from_dict({"label": ["neg", "pos", "neg"]}),
        validation=Dataset.from_dict({"label": ["pos", "neutral"]}),
    )
    with pytest.raises(UsageError, match="validation label 'neutral' does not occur in the training labels"):
        classification.infer_labels(raw, "label", fixed=None)
    raw["validation"] = Dataset.from_dict({"label": ["pos"]})
    labels = classification.infer_labels(raw, "label", fixed=None)
    assert labels.id2label == {0: "neg", 1: "pos"} and labels.encoder()("pos") == 1


@pytest.mark.parametrize(
    ("train", "validation", "message"),
    [
        (
            [0, 2, 0],
            [0],
            "holds int labels 0, 2, without 1: int labels are class ids 0..N-1, each among the training examples",
        ),
        ([3, 5, 4], [3], "holds int labels 3, 4, 5, without 0: int labels are class ids 0..N-1"),
        (["0", "1"], [1], "the training labels are strings and the validation labels ints (such as 1): write them"),
        ([0, 1], ["1"], "the training labels are ints and the validation labels strings (such as '1'): write them"),
        (["pos", "pos"], ["pos"], "holds one class in the training data ('pos'): a classifier learns to tell two"),
    ],
)
def test_labels_that_would_train_a_head_of_classes_never_seen_are_refused(train, validation, message):
    # {0, 2} trained a head of three classes and scored a validation label 1 it never saw; star ratings 3..5 one of
    # six; "0"/"1" against 0/1 said that 1 was not among the training labels (0, 1); one class scored accuracy 1.
    from datasets import Dataset, DatasetDict

    raw = DatasetDict(train=Dataset.from_dict({"label": train}), validation=Dataset.from_dict({"label": validation}))
    with pytest.raises(UsageError, match=re.escape(message)):
        classification.infer_labels(raw, "label", fixed=None)


@pytest.mark.parametrize("source", ["files", "dataset folder"])
def test_csv_cells_that_pandas_calls_missing_are_texts_and_labels_as_written(tmp_path, source):
    # pandas reads NA, null, None and nan as missing: a label "NA" was called an empty cell, a review "None" too; a
    # --dataset_name folder of csv files did so after its --train_file twin no longer did.
    train = tmp_path / "train.csv"
    train.write_text("text,label\nNone,NA\nnull,great\nnan,NA\nN/A,great\n,great\n")
    shutil.copy(train, tmp_path / "validation.csv")
    if source == "files":
        raw = data.load_raw(TrainConfig(train_file=str(train), validation_file=str(train)))
    else:  # with what dataset folders hold besides: a licence, and a test split of another header
        (tmp_path / "LICENSE").write_text("CC0\n")
        (tmp_path / "test.csv").write_text("text\nTrue\n")
        raw = data.load_raw(TrainConfig(dataset_name=str(tmp_path)))
    for split in ("train", "validation"):
        assert raw[split]["text"][:] == ["None", "null", "nan", "N/A", None]
        assert raw[split]["label"][:] == ["NA", "great", "NA", "great", "great"]


def test_a_dataset_folders_csv_files_of_one_split_are_read_as_written_in_any_column_order(tmp_path):
    # Two train files with their columns in another order were read with pandas' type guessing: label 01 merged into
    # 1, silently. Files of other columns are one line.
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "train.csv").write_text("text,label\nfirst,0\nsecond,01\n")
    (tmp_path / "b" / "train.csv").write_text("label,text\n1,third\n01,fourth\n")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "train.csv").write_text("text,label\n")  # a header alone: read, it failed the others' read
    raw = data.load_raw(TrainConfig(dataset_name=str(tmp_path), validation_split_percentage=50))
    rows = sorted(
        zip(
            raw["train"]["text"][:] + raw["validation"]["text"][:],
            raw["train"]["label"][:] + raw["validation"]["label"][:],
        )
    )
    assert rows == [("first", "0"), ("fourth", "01"), ("second", "01"), ("third", "1")], rows

    (tmp_path / "b" / "train.csv").write_text("label,text,extra\n1,third,x\n")
    with pytest.raises(UsageError) as refused:
        data.load_raw(TrainConfig(dataset_name=str(tmp_path), validation_split_percentage=50))
    assert str(refused.value) == (
        f"the train split's csv files have different columns: {tmp_path / 'a' / 'train.csv'} (text, label) and "
        f"{tmp_path / 'b' / 'train.csv'} (label, text, extra); give every file of a split the same columns"
    )


def test_a_dataset_folder_of_json_files_is_read_without_csv_options(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"text": "NA", "label": "null"}\n{"text": "fine", "label": "great"}\n')
    (tmp_path / "validation.jsonl").write_text('{"text": "None", "label": "NA"}\n')
    raw = data.load_raw(TrainConfig(dataset_name=str(tmp_path)))
    assert raw["train"]["text"][:] == ["NA", "fine"] and raw["train"]["label"][:] == ["null", "great"]
    assert raw["validation"]["text"][:] == ["None"] and raw["validation"]["label"][:] == ["NA"]


@pytest.mark.parametrize("seed", range(4))
def test_a_bad_row_is_named_by_its_row_in_the_file_after_a_held_out_split_and_max_samples(tmp_path, seed):
    # Rows were counted in the shuffled splits that --validation_split_percentage made: "row 5 of the train data"
    # for a file whose row 5 was fine, or "row 1 of the validation data" for a file given as training data only.
    rows = [f"review {i},{'great' if i % 2 else 'other'}" for i in range(1, 41)]
    rows[26] = ",great"  # row 27 of the file: an empty text (kept: the seeds below put it in the first 28, or held out)
    train = tmp_path / "train.csv"
    train.write_text("text,label\n" + "\n".join(rows) + "\n")
    cfg = TrainConfig(train_file=str(train), validation_split_percentage=25, seed=seed, max_train_samples=28)
    raw = data.load_raw(cfg)
    split = "validation" if None in raw["validation"]["text"] else "train"
    where = "train data (held out for validation;" if split == "validation" else "train data ("
    with pytest.raises(UsageError, match=re.escape(f"column 'text' is empty in row 27 of the {where}")):
        classification.check_columns(raw, classification.resolve_columns(cfg))


@pytest.mark.parametrize("seed", range(6))
def test_a_bad_row_of_a_small_file_is_named_by_its_row_whichever_rows_are_held_out(tmp_path, seed):
    # A split that datasets selected as one run of rows keeps no map to the file: "row 1" for the file's row 2.
    train = tmp_path / "train.csv"
    train.write_text("text,label\nhello,a\nworld,b\n,b\nagain,a\n")  # row 3: an empty text
    cfg = TrainConfig(train_file=str(train), validation_split_percentage=25, seed=seed)
    raw = data.load_raw(cfg)
    with pytest.raises(UsageError, match=re.escape("column 'text' is empty in row 3 of the train data (")):
        classification.check_columns(raw, classification.resolve_columns(cfg))


@pytest.mark.parametrize("held_out_seed", [None, *range(4)])
def test_a_bad_row_after_blank_lines_is_named_by_its_line_in_the_file(tmp_path, held_out_seed):
    # pandas leaves blank lines (and lines of spaces) out: "row 4 of the train data" for the row on line 9, which a
    # user counting rows after the header finds on line 5. A quoted text over two lines is one row on two lines.
    train = tmp_path / "train.csv"
    train.write_text('text,label\nhello,a\n\n   \n"two\nlines",b\nworld,b\n\r\nagain,a\n,b\nmore,a\nlast,b\n')
    cfg = TrainConfig(train_file=str(train), validation_file=str(train))
    if held_out_seed is not None:
        cfg = TrainConfig(train_file=str(train), validation_split_percentage=25, seed=held_out_seed)
    raw = data.load_raw(cfg)
    split = "validation" if None in raw["validation"]["text"] else "train"
    held_out = " (held out for validation)" if held_out_seed is not None and split == "validation" else ""
    with pytest.raises(UsageError) as refused:
        classification.check_columns(raw, classification.resolve_columns(cfg))
    assert str(refused.value) == f"column 'text' is empty in line 10 of {train}{held_out}; fill it in or drop the row"


def test_a_bad_row_before_any_blank_line_keeps_its_row_number(tmp_path):
    # Blank lines after it (an editor's last empty line) or before the header move no row: the line stays as it was.
    train = tmp_path / "train.csv"
    train.write_text("\ntext,label\nhello,a\nworld,\n\n\n")
    cfg = TrainConfig(train_file=str(train), validation_file=str(train))
    with pytest.raises(UsageError, match=re.escape("'label' is empty in row 2 of the train data (rows counted from 1")):
        classification.infer_labels(data.load_raw(cfg), "label", None)


def test_a_blank_line_of_a_one_column_csv_is_an_empty_document_said_in_the_note(tmp_path, tiny_gpt2_dir):
    # pandas skipped it without a word, where an empty cell of a file of more columns got the note.
    from app.tasks.causal_lm import CausalLM

    corpus = tmp_path / "corpus.csv"
    corpus.write_text("text\nFresh coffee.\n\nStale.\n   \nWould buy again.\n")
    cfg = TrainConfig(task="causal_lm", train_file=str(corpus), validation_file=str(corpus), text_column="text")
    raw = data.load_raw(cfg)
    assert raw["train"]["text"][:] == ["Fresh coffee.", None, "Stale.", "   ", "Would buy again."]
    task = CausalLM.from_data(
        cfg, raw, AutoTokenizer.from_pretrained(tiny_gpt2_dir), AutoConfig.from_pretrained(tiny_gpt2_dir)
    )
    assert "note: 2 of 5 train texts are empty and left out" in task.notes


def test_labels_that_all_carry_the_same_spaces_are_classes_as_written():
    # "text, label" written by hand: every label is " positive" or " negative", consistent classes that trained
    # before labels with spaces were refused; refused are those beside their bare form, or spaced among clean ones.
    from datasets import Dataset, DatasetDict

    def space(train: list[str]):
        raw = DatasetDict(train=Dataset.from_dict({"label": train}), validation=Dataset.from_dict({"label": train}))
        return classification.infer_labels(raw, "label", fixed=None)

    assert space([" positive", " negative", " positive"]).names == (" negative", " positive")
    for mixed in ([" great", "great "], ["great", "other", "other ", "great"]):
        with pytest.raises(UsageError, match="has spaces around it"):
            space(mixed)


def test_a_text_column_named_as_labels_is_refused_in_one_short_line():
    # `--label_column text`: every training row its own class, and a validation row's text is in none of them.
    from datasets import Dataset, DatasetDict

    texts = [f"review number {i} of the kettle" for i in range(classification.FREE_TEXT_ROWS)]
    raw = DatasetDict(
        train=Dataset.from_dict({"text": texts, "label": ["pos", "neg"] * (len(texts) // 2)}),
        validation=Dataset.from_dict({"text": ["another review"], "label": ["pos"]}),
    )
    with pytest.raises(UsageError) as refused:
        classification.infer_labels(raw, "text", fixed=None)
    assert str(refused.value) == (
        f"label column 'text' holds a different value in each of its {len(texts)} training rows: text, not labels; "
        "name the column of labels with --label_column (the columns: text, label)"
    )
    # Few-shot data, a class per example: labels where every validation label is one of them.
    intents = [f"intent{i}" for i in range(len(texts))]
    few_shot = DatasetDict(
        train=Dataset.from_dict({"text": texts, "label": intents}),
        validation=Dataset.from_dict({"text": ["another review"], "label": ["intent3"]}),
    )
    assert classification.infer_labels(few_shot, "label", fixed=None).names == tuple(sorted(intents))
    # The training file given as the validation file too: its texts would pass as labels.
    same_file = DatasetDict(train=raw["train"], validation=raw["train"])
    with pytest.raises(UsageError, match="holds a different value in each of its"):
        classification.infer_labels(same_file, "text", fixed=None)
    raw["train"] = raw["train"].select(range(len(texts) - 1))  # fewer rows: as many classes as rows may be real
    with pytest.raises(UsageError, match="does not occur in the training labels") as refused:
        classification.infer_labels(raw, "text", fixed=None)
    assert str(refused.value).count(",") < 15 and ", and 9 more); " in str(refused.value), "ten labels shown, not 19"


def test_a_trained_head_keeps_its_label_order():
    from datasets import Dataset, DatasetDict

    raw = DatasetDict(
        train=Dataset.from_dict({"label": ["pos", "neg"]}), validation=Dataset.from_dict({"label": ["neg"]})
    )
    labels = classification.infer_labels(raw, "label", fixed={0: "pos", 1: "neg"})
    assert labels.id2label == {0: "pos", 1: "neg"}
    expected = r"'maybe' is not one of the model's trained labels \(pos, neg\); name the labels as the model does"
    with pytest.raises(UsageError, match=expected):
        raw["train"] = Dataset.from_dict({"label": ["pos", "maybe"]})
        classification.infer_labels(raw, "label", fixed={0: "pos", 1: "neg"})
    # A head trained on ids (HF Trainer's int labels, named LABEL_0 and LABEL_1): "name the labels as the model does"
    # asked for LABEL_0; the ids are what it was trained on.
    unnamed = {0: "LABEL_0", 1: "LABEL_1"}
    expected = (
        "label 'neg' names a class, but the model's head was trained on class ids 0 to 1 without names (LABEL_0 to "
        "LABEL_1, as HF Trainer saves int labels): write the labels as those ids, or start from a model without a "
        "trained classification head"
    )
    raw["train"] = Dataset.from_dict({"label": ["pos", "neg"]})
    with pytest.raises(UsageError) as refused:
        classification.infer_labels(raw, "label", fixed=unnamed)
    assert str(refused.value) == expected
    raw = DatasetDict(train=Dataset.from_dict({"label": [1, 0]}), validation=Dataset.from_dict({"label": [0]}))
    assert classification.infer_labels(raw, "label", fixed=unnamed).id2label == unnamed
    raw["train"] = Dataset.from_dict({"label": ["LABEL_0", "LABEL_5"]})  # the ids' names, one out of range
    with pytest.raises(UsageError) as refused:
        classification.infer_labels(raw, "label", fixed=unnamed)
    assert str(refused.value) == (
        "label 'LABEL_5' is out of range for the model's 2 labels (LABEL_0 to LABEL_1); fix the labels or start from "
        "a model without a trained classification head"
    )


def test_an_unreachable_hub_id_is_a_clear_error(tmp_path, capfd):
    code = run_app(
        [
            "--model_name_or_path",
            "nobody-here/no-such-model",
            "--output_dir",
            tmp_path / "out",
            "--logdir",
            tmp_path / "runs",
        ]
    )
    err = capfd.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0
    assert err.startswith("error: --model_name_or_path 'nobody-here/no-such-model' cannot be loaded")


def test_a_hub_dataset_out_of_reach_is_said_in_words(tmp_path, capfd):
    # datasets' own line ended in its exception's class name: "Couldn't reach 'x' on the Hub (OfflineModeIsEnabled)".
    args = ["--dataset_name", "nobody-here/no-such-data", "--output_dir", tmp_path / "out", "--logdir", tmp_path]
    assert run_app(args) == 2
    err = capfd.readouterr().err
    assert err.startswith(
        "error: --dataset_name 'nobody-here/no-such-data' is not a local folder, not in the datasets cache, and the "
        "Hugging Face Hub is out of reach (offline mode: HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set): give a folder "
        "or a cached name, or use --train_file\n"
    ), err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_map_splits_gives_what_map_gives_and_names_each_result_by_split_transform_and_options(review_files):
    from datasets import DatasetDict, load_dataset

    raw = DatasetDict(load_dataset("csv", data_files={k: str(v) for k, v in review_files.items()}))

    def first_words(limit):
        return lambda batch: {"head": [" ".join(text.split()[:limit]) for text in batch["text"]]}

    mapped = data.map_splits(raw, first_words(3), batched=True)
    expected = raw.map(first_words(3), batched=True)
    fingerprints = {name: split._fingerprint for name, split in mapped.items()}
    for name in raw:
        assert mapped[name]["head"] == expected[name]["head"]
    assert len(set(fingerprints.values())) == 2, "each split its own name"
    again = data.map_splits(raw, first_words(3), batched=True)
    assert {name: split._fingerprint for name, split in again.items()} == fingerprints, "the same name every time"
    for other in (data.map_splits(raw, first_words(4), batched=True), data.map_splits(raw, first_words(3))):
        assert not set(split._fingerprint for split in other.values()) & set(fingerprints.values())


def test_map_splits_maps_with_a_transform_that_cannot_be_hashed(review_files):
    import socket

    from datasets import DatasetDict, load_dataset

    raw = DatasetDict(load_dataset("csv", data_files={k: str(v) for k, v in review_files.items()}))
    with socket.socket() as unpicklable:

        def lengths(batch, held=unpicklable):
            return {"n": [len(text) for text in batch["text"]]}

        mapped = data.map_splits(raw, lengths, batched=True)
    assert all(mapped[name]["n"] == [len(text) for text in raw[name]["text"]] for name in raw)


def test_a_tokenizing_transform_is_named_by_its_tokenizers_contents(tiny_model_dir, tmp_path):
    from datasets.fingerprint import Hasher
    from transformers import AutoTokenizer

    from app.inputs.fingerprint import transform_fingerprint

    def encoder(tokenizer, max_length=32):
        return lambda batch: tokenizer(batch["text"], truncation=True, max_length=max_length)

    first, second = AutoTokenizer.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    name = transform_fingerprint(encoder(first))
    assert transform_fingerprint(encoder(second)) == name, "the same files, the same name (every rank, every run)"
    encoder(first)({"text": ["a review long enough to be cut"]})  # leaves truncation set on the backend
    assert transform_fingerprint(encoder(first)) == name, "calling it changes nothing it does"
    assert transform_fingerprint(encoder(first, max_length=16)) != name, "what the transform holds besides counts"
    second.add_tokens(["<new-token>"])
    assert transform_fingerprint(encoder(second)) != name, "another vocabulary, another name"
    third = AutoTokenizer.from_pretrained(tiny_model_dir, do_lower_case=False)
    assert transform_fingerprint(encoder(third)) != name, "another setting, another name"

    def no_tokenizer(batch):
        return {"n": [len(text) for text in batch["text"]]}

    assert transform_fingerprint(no_tokenizer) == Hasher.hash(no_tokenizer), "the rest hashed as datasets hashes it"


def test_a_tokenizer_that_holds_a_set_is_hashed_as_datasets_hashes_it(tiny_model_dir):
    # A set's pickled order follows the process's hash seed: by its contents, the ranks would name their results apart.
    from datasets.fingerprint import Hasher
    from transformers import AutoTokenizer

    from app.inputs.fingerprint import transform_fingerprint

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.reserved = {"names": {f"<extra-{i}>" for i in range(20)}}

    def encode(batch):
        return tokenizer(batch["text"])

    assert transform_fingerprint(encode) == Hasher.hash(encode)


def test_a_csv_column_named_like_pandas_row_labels_is_read_as_a_column(tmp_path):
    # pandas names the row labels it takes from rows longer than their header `__index_level_0__`; a header that
    # holds that name itself (a frame written with its index) is a file like any other.
    written = tmp_path / "indexed.csv"
    written.write_text("__index_level_0__,text,label\n7,good,1\n9,bad,0\n")
    rows = data.read_table(str(written), "--input_file")
    assert list(rows.columns) == ["__index_level_0__", "text", "label"] and list(rows["text"]) == ["good", "bad"]
    cut = tmp_path / "cut.csv"
    cut.write_text("text,label\ngood, really,1\nbad, truly,0\n")
    with pytest.raises(UsageError, match=r"its rows have more fields than its header \(1 more\)"):
        data.read_table(str(cut), "--input_file")


def test_the_separator_hint_is_for_a_header_read_as_one_column():
    from app.inputs.reading import header_hint

    assert header_hint(["text;label"]).startswith(" (the header holds semicolons: a .csv file is read with commas")
    assert header_hint(["text;label", "__index_level_0__"]).startswith(" (the header holds semicolons")
    assert header_hint(["text", "score|v2"], "--label_column", "label") == "", "a json file's columns, one with a bar"


def test_a_dataset_folder_of_csv_files_with_unquoted_commas_is_refused_as_a_train_file_is(tmp_path):
    # Through --dataset_name the first field of each row became a row label, and the texts lost their start, silently.
    folder = tmp_path / "commas"
    folder.mkdir()
    rows = "".join(f"Well, review {i} of the kettle,{'great' if i % 2 else 'other'}\n" for i in range(8))
    (folder / "train.csv").write_text("text,label\n" + rows)
    with pytest.raises(UsageError, match=re.escape(f"cannot read {folder / 'train.csv'}: its rows have more fields")):
        data.load_raw(TrainConfig(dataset_name=str(folder)))


def test_a_token_added_on_top_of_the_vocabulary_past_the_embeddings_is_not_refused(tmp_path, tiny_model_dir):
    # An added token the data never holds (an added <pad> that is not the pad token) trained before the check of a
    # tokenizer larger than the model; a whole vocabulary that does not fit is another model's, and refused.
    from transformers import AutoTokenizer

    from app.inputs.model import load_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_tokens(["<extra_unused>"])
    tokenizer.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert len(load_tokenizer(str(tmp_path), config)) == config.vocab_size + 1
    with pytest.raises(UsageError, match="its tokenizer's vocabulary has 30522 tokens, more than the model's 30000"):
        load_tokenizer(str(tmp_path), AutoConfig.from_pretrained(tiny_model_dir, vocab_size=30000))


def test_a_name_neither_local_nor_cached_fails_without_waiting_through_the_hubs_retries(tmp_path):
    # On a machine without the hub, a typo in a folder's name waited 25 s through five retries (minutes for predict.py's
    # base): app/inputs/hub.py asks once whether the hub answers. A new interpreter, as a user starts it: the suite's
    # own processes run offline from their start. With the hub reachable the name is not found at once: no retry either.
    import subprocess
    import sys

    from tests.conftest import TRAIN_SCRIPT, clean_env

    env = clean_env(tmp_path)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", *hub.PROXIES):
        env.pop(name, None)
    args = ["--model_name_or_path", "nobody-here/no-such-model", "--output_dir", tmp_path / "o", "--logdir", tmp_path]
    done = subprocess.run(
        [sys.executable, TRAIN_SCRIPT, *map(str, args)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "retry" not in done.stderr.lower(), done.stderr[-2000:]
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith("error: --model_name_or_path 'nobody-here/no-such-model' cannot be loaded")
    )


@pytest.mark.parametrize(
    "rows, percent, file, said",
    [
        ("text,label\nhello,a\n", 10, "one.csv", "holding out 10% of the 1 training row (columns: text, label)"),
        ("text,label\n" + "".join(f"t{i},{i % 2}\n" for i in range(40)), 99, "forty.csv", "holding out 99% of the 40"),
    ],
    ids=["one row", "99 percent"],  # a json file of one object: test_a_json_file_of_one_object_is_one_line_not_one_row
)
def test_a_held_out_split_that_leaves_no_training_rows_is_one_line(tmp_path, rows, percent, file, said):
    # datasets' train_test_split raised a ValueError traceback, after the run's folders were made.
    path = tmp_path / file
    path.write_text(rows)
    with pytest.raises(UsageError) as refused:
        data.load_raw(TrainConfig(train_file=str(path), validation_split_percentage=percent))
    assert str(refused.value).startswith(said)
    assert str(refused.value).endswith(
        "for validation leaves none to train on: add rows, lower --validation_split_percentage or give "
        "--validation_file"
    )


@pytest.mark.parametrize(
    "given, flag, default",
    [
        ({"text_column": "label"}, "--text_column 'label'", "--label_column"),
        ({"text_pair_column": "text"}, "--text_pair_column 'text'", "--text_column"),
        ({"text_pair_column": "label"}, "--text_pair_column 'label'", "--label_column"),
        ({"label_column": "text"}, "--label_column 'text'", "--text_column"),
    ],
)
def test_a_flag_naming_a_defaulted_roles_column_is_refused(given, flag, default):
    # --text_column label trained the classifier on its own labels: eval/accuracy 1.0 on a model that learned nothing.
    with pytest.raises(UsageError) as refused:
        classification.resolve_columns(TrainConfig(train_file="t.csv", **given))
    assert str(refused.value) == (
        f"{flag} is the column that {default} reads by default: each role takes its own column; give "
        f"{flag.split()[0]} another column, or {default} too"
    )
    classification.resolve_columns(TrainConfig(train_file="t.csv", **given, **{default.removeprefix("--"): "other"}))


@pytest.mark.parametrize(
    "labels, names, ids_as_written",
    [
        (["True", "False", "True", "False"], ("False", "True"), False),  # read as bools: "give ints or strings"
        (["01", "1", "01", "1"], ("01", "1"), False),  # both read as the int 1: two classes merged
        ([str(i) for i in range(1, 11)] * 2, tuple(sorted(str(i) for i in range(1, 11))), False),  # "renumber from 0"
        (["1", "0", "2", "1"], ("0", "1", "2"), True),  # the class ids, as a json file's ints
    ],
    ids=["booleans", "codes with a leading zero", "ratings 1 to 10", "class ids"],
)
def test_csv_labels_are_read_as_written_and_whole_numbers_from_0_are_class_ids(tmp_path, labels, names, ids_as_written):
    # pandas guessed the types of csv cells: advice that a csv cannot follow ("write them as strings"), or classes
    # merged without a word. Numbers written as names sort as strings do, as in HF's scripts and in older runs.
    rows = "".join(f"{1000 + i},{label}\n" for i, label in enumerate(labels))  # numbers as texts, too
    (tmp_path / "train.csv").write_text("text,label\n" + rows)
    (tmp_path / "validation.csv").write_text("text,label\n" + rows)
    raw = data.load_raw(
        TrainConfig(train_file=str(tmp_path / "train.csv"), validation_file=str(tmp_path / "validation.csv"))
    )
    assert raw["train"]["text"][:2] == ["1000", "1001"]
    space = classification.infer_labels(raw, "label", fixed=None)
    assert space.names == names and space.string_labels is not ids_as_written
    assert [space.encoder()(v) for v in raw["train"]["label"]] == [names.index(v) for v in labels]


def test_whole_numbers_in_a_csv_fit_a_trained_heads_ids_and_decimals_are_refused_as_json_floats_are(tmp_path):
    path = tmp_path / "ids.csv"
    path.write_text("text,label\na,1\nb,0\nc,1\n")
    raw = data.load_raw(TrainConfig(train_file=str(path), validation_file=str(path)))
    trained = classification.infer_labels(raw, "label", fixed={0: "LABEL_0", 1: "LABEL_1"})
    assert trained.names == ("LABEL_0", "LABEL_1") and trained.encoder()("1") == 1
    # A head trained on ratings "1" to "3" names its classes so: "1" is class 0, not class 1 ("2").
    named = classification.infer_labels(raw, "label", fixed={0: "0", 1: "1", 2: "2"})
    assert named.encoder()("1") == 1
    path.write_text("text,label\na,1\nb,2\nc,1\n")
    raw = data.load_raw(TrainConfig(train_file=str(path), validation_file=str(path)))
    stars = classification.infer_labels(raw, "label", fixed={0: "1", 1: "2", 2: "3"})
    assert stars.names == ("1", "2", "3") and [stars.encoder()(v) for v in ("1", "2")] == [0, 1]
    # The first float was whole, 2.0: the advice was to write class ids as ints, for a regression target.
    for name, cells in (("floats.csv", ["2.0", "0.5", "1.0"]), ("floats.jsonl", [2.0, 0.5, 1.0])):
        path = tmp_path / name
        if name.endswith(".csv"):
            path.write_text("text,label\n" + "".join(f"t{i},{v}\n" for i, v in enumerate(cells)))
        else:
            path.write_text("".join(json.dumps({"text": f"t{i}", "label": v}) + "\n" for i, v in enumerate(cells)))
        raw = data.load_raw(TrainConfig(train_file=str(path), validation_file=str(path)))
        with pytest.raises(UsageError, match="found float 0.5: a float target is regression"):
            classification.infer_labels(raw, "label", fixed=None)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_int_labels_that_a_trained_head_has_as_names_are_those_classes_as_in_a_csv(tmp_path, suffix):
    # Ratings 1 to 4 in a jsonl, on a head trained on "1" to "5": each trained as the next rating up (1 as "2", the
    # head's id 1), where the same numbers in a csv were taken by name; ratings 1 to 5 were refused as out of range.
    path = tmp_path / f"ratings{suffix}"
    rows = [{"text": f"t{i}", "label": i % 4 + 1} for i in range(8)]
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        import pandas

        pandas.DataFrame(rows).to_parquet(path)
    raw = data.load_raw(TrainConfig(train_file=str(path), validation_file=str(path)))
    assert raw["train"]["label"][:4] == [1, 2, 3, 4]
    stars = {0: "1", 1: "2", 2: "3", 3: "4", 4: "5"}
    space = classification.infer_labels(raw, "label", fixed=stars)
    assert space.names == ("1", "2", "3", "4", "5")
    assert [space.encoder()(v) for v in raw["train"]["label"][:4]] == [0, 1, 2, 3]
    # Numbers that are not all the head's names are its class ids, as in a csv: 0 is no rating.
    raw = data.load_raw(TrainConfig(train_file=str(path), validation_file=str(path)))
    ids = classification.infer_labels(raw.map(lambda row: {"label": row["label"] - 1}), "label", fixed=stars)
    assert [ids.encoder()(v) for v in (0, 3)] == [0, 3]


@pytest.mark.parametrize("suffix", [".csv", ".json", ".jsonl", ".parquet"])
def test_a_file_of_zero_bytes_is_said_to_have_no_rows(tmp_path, suffix):
    # A .json file of zero bytes was "cannot read empty.json: StopIteration; check the file's format".
    path = tmp_path / f"empty{suffix}"
    path.write_bytes(b"")
    with pytest.raises(UsageError) as refused:
        data.load_raw(TrainConfig(train_file=str(path)))
    assert str(refused.value) == f"{path} has no rows, so the train split is empty; add examples to it"


def test_a_json_line_with_a_lone_surrogate_escape_is_named_by_its_line(tmp_path):
    # pyarrow refuses it and counts its rows from 0 ("in row 10" for line 11); Python's json took it, so the app's own
    # recheck of the lines found nothing to name.
    lines = [json.dumps({"text": f"review {i}", "label": "ab"[i % 2]}) for i in range(20)]
    lines[10] = '{"text": "bad \\ud800 here", "label": "a"}'
    path = tmp_path / "surrogate.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(UsageError) as refused:
        data.load_raw(TrainConfig(train_file=str(path)))
    assert str(refused.value) == (
        f"cannot read {path}: line 11 holds an escaped lone surrogate (such as \\ud800), which is no character; fix "
        "that line"
    )


@pytest.mark.parametrize("names", [("neg", "pos", "rare"), (0, 2, 1)])
def test_a_held_out_validation_split_is_said_and_named_when_it_takes_a_whole_class(tmp_path, names):
    # The draw follows --seed and was not said: with one seed the run trained, with another it was refused with
    # "drop its validation rows", though the user gave no validation rows. A json file's int class 1 was told
    # "int labels 0 and 2, without 1: ... renumber them from 0".
    from app.tasks.classification import infer_labels

    train = tmp_path / "train.jsonl"
    rows = [{"text": f"review {i}", "label": names[i % 2]} for i in range(24)] + [{"text": "odd", "label": names[2]}]
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    seed = next(
        s
        for s in range(50)
        if names[2] in data.load_raw(TrainConfig(train_file=str(train), seed=s))["validation"]["label"]
    )
    cfg = TrainConfig(train_file=str(train), seed=seed)
    raw = data.load_raw(cfg)
    assert data.held_out_note(raw, cfg) == [
        f"note: no validation data given: 3 rows (10%) held out from the training data at random with --seed {seed}; "
        "a --validation_file keeps the evaluation the same across seeds"
    ]
    with pytest.raises(UsageError) as refused:
        infer_labels(raw, "label", None)
    rare = repr(names[2])
    assert str(refused.value) == (
        f"validation label {rare} does not occur in the training labels ({names[0]}, {names[1]}): the validation rows "
        "held out from the training data (--validation_split_percentage, drawn with --seed) took every row of it; add "
        "examples of it, or give a --validation_file"
    )
    given = data.load_raw(TrainConfig(train_file=str(train), validation_file=str(train)))
    assert data.held_out_note(given, cfg) == []


def test_a_cut_by_max_samples_is_named_as_the_cause_not_the_held_out_draw(tmp_path):
    from app.tasks.classification import infer_labels

    train = tmp_path / "train.csv"
    train.write_text("text,label\n" + "\n".join(f"review {i},{['pos', 'neg', 'mid'][i % 3]}" for i in range(60)) + "\n")
    cfg = TrainConfig(train_file=str(train), max_train_samples=2, max_eval_samples=2)
    raw = data.load_raw(cfg)
    assert data.held_out_note(raw, cfg) == [
        "note: no validation data given: 6 rows (10%), of which --max_eval_samples keeps 2, held out from the training "
        "data at random with --seed 42; a --validation_file keeps the evaluation the same across seeds"
    ]
    trained = sorted(set(raw["train"]["label"]))
    if set(raw["validation"]["label"]) <= set(trained):  # the draw of seed 42 leaves one out: the setup's point
        pytest.fail(f"the setup should leave a validation label out of the 2 training rows: {trained}")
    with pytest.raises(UsageError) as refused:
        infer_labels(raw, "label", None)
    assert "training rows that --max_train_samples keeps" in str(refused.value), refused.value
    assert "raise --max_train_samples" in str(refused.value) and "held out" not in str(refused.value)


def test_a_validation_label_absent_from_the_whole_training_file_is_not_blamed_on_the_cut(tmp_path):
    from app.tasks.classification import infer_labels

    train, validation = tmp_path / "train.csv", tmp_path / "validation.csv"
    train.write_text("text,label\n" + "\n".join(f"review {i},{['pos', 'neg'][i % 2]}" for i in range(20)) + "\n")
    validation.write_text("text,label\nfine,pos\nso-so,mid\n")
    raw = data.load_raw(TrainConfig(train_file=str(train), validation_file=str(validation), max_train_samples=10))
    with pytest.raises(UsageError) as refused:
        infer_labels(raw, "label", None)
    assert str(refused.value).endswith("add examples of it to the training data or drop its validation rows")


@pytest.mark.parametrize("saved_as", ["save_to_disk", "parquet"])
def test_the_class_names_of_a_datasets_classlabel_name_the_models_labels(tmp_path, tiny_model_dir, saved_as):
    # A hub dataset's, a saved DatasetDict's or its parquet's ClassLabel: the model's labels were 0, 1, 2.
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

    features = Features({"text": Value("string"), "label": ClassLabel(names=["negative", "positive", "neutral"])})
    rows = lambda n: {"text": [f"review {i}" for i in range(n)], "label": [i % 3 for i in range(n)]}  # noqa: E731
    splits = DatasetDict(train=Dataset.from_dict(rows(30), features), validation=Dataset.from_dict(rows(9), features))
    if saved_as == "save_to_disk":
        splits.save_to_disk(tmp_path / "saved")
        source = ["--dataset_name", tmp_path / "saved"]
    else:
        for split, rows_of_split in splits.items():
            rows_of_split.to_parquet(tmp_path / f"{split}.parquet")
        source = ["--train_file", tmp_path / "train.parquet", "--validation_file", tmp_path / "validation.parquet"]
    args = ["--model_name_or_path", tiny_model_dir, *source, "--output_dir", tmp_path / "out"]
    assert run_app([*args, "--logdir", tmp_path / "runs", "--max_steps", "1", "--disable_tqdm"]) == 0
    config = AutoConfig.from_pretrained(tmp_path / "out")
    assert config.id2label == {0: "negative", 1: "positive", 2: "neutral"}


def test_a_file_given_as_dataset_name_is_one_line_not_the_hubs_retries(tmp_path, monkeypatch):
    # Taken for a hub id: five retries (about 23 s), ten lines of "Retrying", then "Couldn't reach 'cls.csv'".
    (tmp_path / "cls.csv").write_text("text,label\na,x\nb,y\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError) as refused:
        data.load_raw(TrainConfig(dataset_name="cls.csv"))
    assert str(refused.value) == (
        "--dataset_name cls.csv is a file: give it with --train_file (and --validation_file), or give the folder of a "
        "dataset's files"
    )


def test_a_datasets_test_split_taken_for_validation_is_said(tmp_path):
    # A folder of train.csv and test.csv evaluated on test.csv, and chose the best model on it, without a word.
    folder = tmp_path / "reviews"
    folder.mkdir()
    for split, n in (("train", 12), ("test", 4)):
        (folder / f"{split}.csv").write_text("text,label\n" + "".join(f"review {i},{i % 2}\n" for i in range(n)))
    cfg = TrainConfig(dataset_name=str(folder))
    raw = data.load_raw(cfg)
    assert len(raw["validation"]) == 4
    assert data.held_out_note(raw, cfg) == [
        f"note: --dataset_name {folder} has no validation split: its test split (4 rows) is the validation data"
    ]
    (folder / "validation.csv").write_text("text,label\nreview,1\n")
    assert data.held_out_note(data.load_raw(cfg), cfg) == []


@pytest.mark.parametrize("layout", ["columns", "records under a key"])
def test_a_json_file_of_one_object_is_one_line_not_one_row(tmp_path, layout):
    # Read by datasets as one row: "holding out 10% of the 1 training row", or a text cell holding a whole column.
    texts, labels = [f"review {i}" for i in range(40)], [i % 2 for i in range(40)]
    whole = (
        {"text": texts, "label": labels}
        if layout == "columns"
        else {"data": [dict(text=t, label=lab) for t, lab in zip(texts, labels)]}
    )
    (tmp_path / "train.json").write_text(json.dumps(whole))
    with pytest.raises(UsageError) as refused:
        data.load_raw(TrainConfig(train_file=str(tmp_path / "train.json")))
    assert str(refused.value).startswith(f"{tmp_path / 'train.json'} is one JSON object, read as one row; write the ")
    (tmp_path / "lines.json").write_text(
        "\n".join(json.dumps({"text": t, "label": lab}) for t, lab in zip(texts, labels))
    )
    assert len(data.load_raw(TrainConfig(train_file=str(tmp_path / "lines.json")))["train"]) == 36  # JSON lines


def test_one_split_saved_with_save_to_disk_says_how_to_save_a_dataset_of_splits(tmp_path):
    # datasets' own line advised load_from_disk, which no flag of the app reaches.
    from datasets import Dataset

    Dataset.from_dict({"text": ["a", "b"], "label": [0, 1]}).save_to_disk(tmp_path / "train")
    with pytest.raises(UsageError) as refused:
        data.load_raw(TrainConfig(dataset_name=str(tmp_path / "train")))
    assert str(refused.value) == (
        f"--dataset_name {tmp_path / 'train'} is one split saved with save_to_disk; save its splits together "
        "(DatasetDict(train=..., validation=...).save_to_disk), or give files with --train_file"
    )


def test_a_json_file_of_one_record_or_of_json_lines_is_read_as_records(tmp_path):
    # One record alone was refused as "one JSON object"; JSON lines in a .json file were read by arrow for predict.py
    # (a time made a timestamp) and escaped the check of strings read as JSON.
    (tmp_path / "one.json").write_text(json.dumps({"text": "a review", "label": 1}))
    rows = [
        {"text": "a", "label": 0, "when": "2024-01-02 10:00"},
        {"text": "b", "label": 1, "when": "2024-01-03 11:00"},
    ]
    (tmp_path / "lines.json").write_text("\n".join(map(json.dumps, rows)) + "\n")
    raw = data.load_raw(
        TrainConfig(train_file=str(tmp_path / "lines.json"), validation_file=str(tmp_path / "one.json"))
    )
    assert len(raw["validation"]) == 1
    assert data.read_table(str(tmp_path / "lines.json"), "--input_file")["when"].tolist() == [r["when"] for r in rows]


def test_a_classlabel_column_with_one_class_in_the_training_rows_is_refused():
    # Its declared names made a head of two classes, and a split sorted by label cut to its first rows (IMDB with
    # --max_train_samples) trained on negatives alone.
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

    features = Features({"text": Value("string"), "label": ClassLabel(names=["neg", "pos"])})
    split = lambda labels: Dataset.from_dict({"text": ["t"] * len(labels), "label": labels}, features)  # noqa: E731
    raw = DatasetDict(train=split([1, 1, 1]), validation=split([0, 1]))
    with pytest.raises(UsageError, match="label column 'label' holds one class in the training data \\('pos'\\)"):
        classification.infer_labels(raw, "label", fixed=None)


def test_labels_that_differ_only_in_case_are_two_classes_with_a_note(tiny_model_dir):
    from datasets import Dataset, DatasetDict

    cfg = TrainConfig(model_name_or_path=str(tiny_model_dir), text_column="text", label_column="label")
    tokenizer, model_config = AutoTokenizer.from_pretrained(tiny_model_dir), AutoConfig.from_pretrained(tiny_model_dir)
    texts = ["a", "b", "c", "d"]
    cases = [(["great", "Great", "bad", "great"], ("Great", "great")), (["great", "bad"] * 2, None)]
    cases += [(["strasse", "straße", "weg", "weg"], None)]  # other letters, not only case (casefold made them one)
    for labels, twins in cases:
        raw = DatasetDict(
            train=Dataset.from_dict({"text": texts, "label": labels}),
            validation=Dataset.from_dict({"text": texts[:2], "label": labels[:2]}),
        )
        task = classification.SequenceClassification.from_data(cfg, raw, tokenizer, model_config)
        said = [note for note in task.notes if "differ only in case" in note]
        assert said == (
            [
                f"note: the labels {twins[0]!r} and {twins[1]!r} differ only in case, so they are two "
                "classes; if they are one, write them alike"
            ]
            if twins
            else []
        )
        assert len(task.labels.names) == len(set(labels))
