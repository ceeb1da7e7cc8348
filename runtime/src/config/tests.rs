//! The serving and proxy configs through every layer: defaults, file, environment, flags.

use super::*;
use figment::Jail;
use serde::Serialize;
use std::fmt;

fn no_flags() -> ServeFlags {
    ServeFlags::default()
}

#[test]
fn defaults_validate_and_match_documented_values() {
    let c = ServeConfig::default();
    c.validate().unwrap();
    assert_eq!(c.model.source, "default");
    assert_eq!(c.model.weights, WeightFormat::Auto);
    assert_eq!(c.transfer.backend, TransferBackend::Shm);
    assert_eq!(c.transfer.mode, TransferMode::Pull);
    assert!(c.transfer.require_auth);
    assert_eq!(c.model.tp, 1);
    assert_eq!(c.server.host, "127.0.0.1");
    assert_eq!(c.server.port, 8000);
    assert_eq!(c.server.max_concurrent_requests, 256);
    assert_eq!(c.server.request_timeout_s, 600);
    assert_eq!(c.scheduler.max_num_seqs, 64);
    assert_eq!(c.scheduler.max_num_batched_tokens, 512);
    assert_eq!(c.scheduler.block_size, 16);
    assert_eq!(c.scheduler.kv_cache_bytes, 512 << 20);
    assert_eq!(c.instance.role, Role::Colocated);
    assert_eq!(c.logging.format, LogFormat::Human);
    assert_eq!(c.multimodal.max_images_per_request, 8);
    assert_eq!(c.multimodal.max_image_bytes, 4 << 20);
    assert_eq!(c.multimodal.encoder_cache_bytes, 64 << 20);
    assert_eq!(
        (c.multimodal.max_image_width, c.multimodal.max_image_height),
        (4096, 4096)
    );
}

#[test]
fn load_without_any_layer_gives_defaults() {
    Jail::expect_with(|_| {
        assert_eq!(
            ServeConfig::load(None, no_flags()).unwrap(),
            ServeConfig::default()
        );
        Ok(())
    });
}

#[test]
fn file_then_env_then_flags_each_override_the_previous() {
    Jail::expect_with(|jail| {
        jail.create_file(
            "pd.toml",
            r#"
            [server]
            port = 9001
            host = "0.0.0.0"
            [scheduler]
            max_num_seqs = 10
            block_size = 32
            [instance]
            role = "prefill"
            "#,
        )?;
        let path = Path::new("pd.toml");

        // The file alone beats the defaults.
        let c = ServeConfig::load(Some(path), no_flags()).unwrap();
        assert_eq!((c.server.port, c.server.host.as_str()), (9001, "0.0.0.0"));
        assert_eq!(c.scheduler.max_num_seqs, 10);
        assert_eq!(c.instance.role, Role::Prefill);

        // The environment beats the file for the same key; other file keys survive.
        jail.set_env("PDSERVE_SERVER__PORT", "9002");
        jail.set_env("PDSERVE_SCHEDULER__MAX_NUM_SEQS", "8");
        jail.set_env("PDSERVE_INSTANCE__ROLE", "decode");
        let c = ServeConfig::load(Some(path), no_flags()).unwrap();
        assert_eq!(c.server.port, 9002);
        assert_eq!(c.server.host, "0.0.0.0");
        assert_eq!(c.scheduler.max_num_seqs, 8);
        assert_eq!(c.scheduler.block_size, 32);
        assert_eq!(c.instance.role, Role::Decode);

        // Flags beat the environment; unset flags leave the lower layers alone.
        let flags = ServeFlags {
            port: Some(9003),
            role: Some(Role::Colocated),
            ..Default::default()
        };
        let c = ServeConfig::load(Some(path), &flags).unwrap();
        assert_eq!(c.server.port, 9003);
        assert_eq!(c.instance.role, Role::Colocated);
        assert_eq!(c.scheduler.max_num_seqs, 8);
        assert_eq!(c.scheduler.block_size, 32);
        assert_eq!(c.server.host, "0.0.0.0");
        Ok(())
    });
}

/// `scheduler.kv_cache_dtype`: file, then environment, then flag; a bad value names the key.
#[test]
fn kv_cache_dtype_overrides_through_file_env_and_flag() {
    Jail::expect_with(|jail| {
        jail.create_file("kv.toml", "[scheduler]\nkv_cache_dtype = \"bf16\"\n")?;
        let path = Path::new("kv.toml");
        assert_eq!(
            ServeConfig::load(None, no_flags())
                .unwrap()
                .scheduler
                .kv_cache_dtype,
            KvCacheDtype::F32
        );
        let c = ServeConfig::load(Some(path), no_flags()).unwrap();
        assert_eq!(c.scheduler.kv_cache_dtype, KvCacheDtype::Bf16);
        jail.set_env("PDSERVE_SCHEDULER__KV_CACHE_DTYPE", "f16");
        let c = ServeConfig::load(Some(path), no_flags()).unwrap();
        assert_eq!(c.scheduler.kv_cache_dtype, KvCacheDtype::F16);
        let flags = ServeFlags {
            kv_cache_dtype: Some("f32".into()),
            ..Default::default()
        };
        assert_eq!(
            ServeConfig::load(Some(path), &flags)
                .unwrap()
                .scheduler
                .kv_cache_dtype,
            KvCacheDtype::F32
        );
        let bad = ServeFlags {
            kv_cache_dtype: Some("fp8".into()),
            ..Default::default()
        };
        let msg = ServeConfig::load(Some(path), &bad).unwrap_err().to_string();
        assert!(
            msg.contains("scheduler.kv_cache_dtype") && msg.contains("fp8"),
            "{msg}"
        );
        Ok(())
    });
}

/// Every transfer-engine key: a value from the file, beaten by one from the environment,
/// beaten by one from the flags; each layer is seen in the loaded config.
#[test]
fn transfer_engine_keys_override_through_file_env_and_flags() {
    type SetFlag = fn(&mut ServeFlags);
    type Get = fn(&TransferSection) -> String;
    /// Key, file value, environment value, flag setter, getter, what each layer gives.
    type Case = (
        &'static str,
        &'static str,
        &'static str,
        SetFlag,
        Get,
        [&'static str; 3],
    );
    let cases: Vec<Case> = vec![
        (
            "advertise_addr",
            "\"10.0.0.1\"",
            "10.0.0.2",
            |f| f.transfer_advertise_addr = Some("10.0.0.3:7000".into()),
            |t| format!("{:?}", t.advertise_addr),
            [
                "Some(\"10.0.0.1\")",
                "Some(\"10.0.0.2\")",
                "Some(\"10.0.0.3:7000\")",
            ],
        ),
        (
            "io_threads",
            "3",
            "4",
            |f| f.transfer_io_threads = Some(5),
            |t| t.io_threads.to_string(),
            ["3", "4", "5"],
        ),
        (
            "memcpy_threads",
            "3",
            "4",
            |f| f.transfer_memcpy_threads = Some(5),
            |t| t.memcpy_threads.to_string(),
            ["3", "4", "5"],
        ),
        (
            "queue_depth",
            "30",
            "40",
            |f| f.transfer_queue_depth = Some(50),
            |t| t.queue_depth.to_string(),
            ["30", "40", "50"],
        ),
        (
            "piece_bytes",
            "65536",
            "131072",
            |f| f.transfer_piece_bytes = Some(262144),
            |t| t.piece_bytes.to_string(),
            ["65536", "131072", "262144"],
        ),
        (
            "tcp_connections",
            "2",
            "6",
            |f| f.transfer_tcp_connections = Some(8),
            |t| t.tcp_connections.to_string(),
            ["2", "6", "8"],
        ),
        (
            "registration_chunk_bytes",
            "8192",
            "16384",
            |f| f.transfer_registration_chunk_bytes = Some(32768),
            |t| format!("{:?}", t.registration_chunk_bytes),
            ["Some(8192)", "Some(16384)", "Some(32768)"],
        ),
        (
            "require_auth",
            "true",
            "false",
            |f| f.transfer_require_auth = Some(true),
            |t| t.require_auth.to_string(),
            ["true", "false", "true"],
        ),
        (
            "tcp_integrity",
            "\"mac\"",
            "encrypt",
            |f| f.transfer_tcp_integrity = Some("none".into()),
            |t| t.tcp_integrity.clone(),
            ["mac", "encrypt", "none"],
        ),
        (
            "rdma_devices",
            "\"mlx5_0\"",
            "mlx5_1",
            |f| f.rdma_devices = Some("mlx5_2,mlx5_3".into()),
            |t| t.rdma_devices.clone(),
            ["mlx5_0", "mlx5_1", "mlx5_2,mlx5_3"],
        ),
        (
            "rdma_port",
            "2",
            "3",
            |f| f.rdma_port = Some(4),
            |t| t.rdma_port.to_string(),
            ["2", "3", "4"],
        ),
        (
            "rdma_gid_index",
            "1",
            "3",
            |f| f.rdma_gid_index = Some(5),
            |t| format!("{:?}", t.rdma_gid_index),
            ["Some(1)", "Some(3)", "Some(5)"],
        ),
        (
            "rdma_mtu",
            "1024",
            "2048",
            |f| f.rdma_mtu = Some(4096),
            |t| format!("{:?}", t.rdma_mtu),
            ["Some(1024)", "Some(2048)", "Some(4096)"],
        ),
        (
            "rdma_send_queue_depth",
            "64",
            "128",
            |f| f.rdma_send_queue_depth = Some(256),
            |t| t.rdma_send_queue_depth.to_string(),
            ["64", "128", "256"],
        ),
        (
            "rdma_cq_depth",
            "2048",
            "4096",
            |f| f.rdma_cq_depth = Some(8192),
            |t| t.rdma_cq_depth.to_string(),
            ["2048", "4096", "8192"],
        ),
    ];
    for (key, file_value, env_value, set_flag, get, expect) in cases {
        Jail::expect_with(|jail| {
            jail.create_file("pd.toml", &format!("[transfer]\n{key} = {file_value}\n"))?;
            let path = Some(Path::new("pd.toml"));
            let c = ServeConfig::load(path, no_flags()).unwrap_or_else(|e| panic!("{key}: {e}"));
            assert_eq!(get(&c.transfer), expect[0], "{key} from the file");
            jail.set_env(env_var_name(&format!("transfer.{key}")), env_value);
            let c = ServeConfig::load(path, no_flags()).unwrap_or_else(|e| panic!("{key}: {e}"));
            assert_eq!(get(&c.transfer), expect[1], "{key} from the environment");
            let mut flags = ServeFlags::default();
            set_flag(&mut flags);
            let c = ServeConfig::load(path, &flags).unwrap_or_else(|e| panic!("{key}: {e}"));
            assert_eq!(get(&c.transfer), expect[2], "{key} from the flags");
            Ok(())
        });
    }
}

#[test]
fn transfer_engine_keys_are_validated_without_a_device() {
    type Mutation = fn(&mut TransferSection);
    let cases: Vec<(&str, Mutation)> = vec![
        ("transfer.advertise_addr", |t| {
            t.advertise_addr = Some("host.example".into())
        }),
        ("transfer.io_threads", |t| t.io_threads = 0),
        ("transfer.memcpy_threads", |t| t.memcpy_threads = 65),
        ("transfer.queue_depth", |t| t.queue_depth = 0),
        ("transfer.piece_bytes", |t| t.piece_bytes = 100),
        ("transfer.tcp_connections", |t| t.tcp_connections = 65),
        ("transfer.registration_chunk_bytes", |t| {
            t.registration_chunk_bytes = Some(1)
        }),
        ("transfer.tcp_integrity", |t| {
            t.tcp_integrity = "sign".into()
        }),
        ("transfer.rdma_devices", |t| {
            t.rdma_devices = "mlx5 0".into()
        }),
        ("transfer.rdma_port", |t| t.rdma_port = 0),
        ("transfer.rdma_mtu", |t| t.rdma_mtu = Some(1500)),
        ("transfer.rdma_send_queue_depth", |t| {
            t.rdma_send_queue_depth = 0
        }),
        ("transfer.rdma_cq_depth", |t| t.rdma_cq_depth = 10),
    ];
    for (key, mutate) in cases {
        let mut c = ServeConfig::default();
        mutate(&mut c.transfer);
        let err = c.validate().expect_err(key);
        assert_eq!(err.key(), Some(key), "{err}");
    }
    let mut t = TransferSection {
        rdma_devices: " mlx5_0, ,mlx5_1 ".into(),
        ..TransferSection::default()
    };
    assert_eq!(t.rdma_device_list(), vec!["mlx5_0", "mlx5_1"]);
    t.advertise_addr = Some("10.1.2.3:9000".into());
    assert!(t.invalid().is_none());
}

#[test]
fn every_flag_lands_on_its_key() {
    Jail::expect_with(|_| {
        let flags = ServeFlags {
            model: Some("synthetic:tiny".into()),
            served_model_name: vec!["served".into(), "alias".into()],
            tp: Some(2),
            weights: Some("f32".into()),
            host: Some("0.0.0.0".into()),
            port: Some(1234),
            api_key: Some("sk-1".into()),
            role: Some(Role::Decode),
            name: Some("d-1".into()),
            max_num_seqs: Some(4),
            max_num_batched_tokens: Some(64),
            block_size: Some(8),
            num_blocks: Some(100),
            log_filter: Some("debug".into()),
            log_format: Some(LogFormat::Json),
            transfer: Some("tcp".into()),
            transfer_listen: Some("127.0.0.1:7000".into()),
            credentials_dir: Some("/tmp/creds".into()),
            transfer_mode: Some("push".into()),
            min_remote_prompt_tokens: Some(64),
            control_listen: Some("127.0.0.1:7100".into()),
            control_proxy: Some("127.0.0.1:7000".into()),
            // The transfer engine's keys: `transfer_engine_keys_override_through_...`;
            // `device` and `dtype`: the CUDA tests.
            ..Default::default()
        };
        let c = ServeConfig::load(None, &flags).unwrap();
        assert_eq!(c.transfer.mode, TransferMode::Push);
        assert_eq!(c.transfer.min_remote_prompt_tokens, 64);
        assert_eq!(c.control.listen, "127.0.0.1:7100");
        assert_eq!(c.control.proxy.as_deref(), Some("127.0.0.1:7000"));
        assert_eq!(c.transfer.backend, TransferBackend::Tcp);
        assert_eq!(c.transfer.listen, "127.0.0.1:7000");
        assert_eq!(c.transfer.credentials_dir.as_deref(), Some("/tmp/creds"));
        assert_eq!(c.model.source, "synthetic:tiny");
        assert_eq!(c.model.name, ["served", "alias"]);
        assert_eq!(c.model.tp, 2);
        assert_eq!(c.model.weights, WeightFormat::F32);
        // The device flags, in a load of their own (f32 is a CPU weight format).
        let cuda = ServeFlags {
            device: Some("cuda:2".into()),
            dtype: Some("bf16".into()),
            ..ServeFlags::default()
        };
        let d = ServeConfig::load(None, &cuda).unwrap();
        assert_eq!(
            (d.model.device.as_str(), d.model.dtype.as_str()),
            ("cuda:2", "bf16")
        );
        assert_eq!(c.server.host, "0.0.0.0");
        assert_eq!(c.server.port, 1234);
        assert_eq!(c.server.api_key.as_deref(), Some("sk-1"));
        assert_eq!(c.instance.role, Role::Decode);
        assert_eq!(c.instance.name, "d-1");
        assert_eq!(c.scheduler.max_num_seqs, 4);
        assert_eq!(c.scheduler.max_num_batched_tokens, 64);
        assert_eq!(c.scheduler.block_size, 8);
        assert_eq!(c.scheduler.num_blocks, Some(100));
        assert_eq!(c.logging.filter, "debug");
        assert_eq!(c.logging.format, LogFormat::Json);
        Ok(())
    });
}

#[test]
fn unknown_key_in_toml_names_key_and_file() {
    Jail::expect_with(|jail| {
        jail.create_file("pd.toml", "[scheduler]\nmax_num_seq = 4\n")?;
        let err = ServeConfig::load(Some(Path::new("pd.toml")), no_flags()).unwrap_err();
        assert_eq!(err.kind(), "config_unknown_key");
        let msg = err.to_string();
        assert!(msg.contains("scheduler.max_num_seq"), "{msg}");
        assert!(msg.contains("pd.toml"), "{msg}");
        match err {
            ConfigError::UnknownKey { key, layer, .. } => {
                assert_eq!(key, "scheduler.max_num_seq");
                assert!(matches!(layer, Some(ConfigLayer::File(_))), "{layer:?}");
            }
            other => panic!("{other:?}"),
        }
        Ok(())
    });
}

#[test]
fn unknown_section_in_toml_rejected() {
    Jail::expect_with(|jail| {
        jail.create_file("pd.toml", "[sheduler]\nmax_num_seqs = 4\n")?;
        let err = ServeConfig::load(Some(Path::new("pd.toml")), no_flags()).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("sheduler"), "{msg}");
        assert_eq!(err.kind(), "config_unknown_key");
        Ok(())
    });
}

#[test]
fn unknown_env_key_rejected_with_variable_name() {
    Jail::expect_with(|jail| {
        jail.set_env("PDSERVE_SERVER__PROTT", "9000");
        let err = ServeConfig::load(None, no_flags()).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("server.prott"), "{msg}");
        assert!(msg.contains("PDSERVE_SERVER__PROTT"), "{msg}");
        assert_eq!(err.key(), Some("server.prott"));
        assert!(
            matches!(
                err,
                ConfigError::UnknownKey {
                    layer: Some(ConfigLayer::Env(_)),
                    ..
                }
            ),
            "{err:?}"
        );
        Ok(())
    });
}

#[test]
fn unrelated_pdserve_variables_are_ignored() {
    Jail::expect_with(|jail| {
        jail.set_env("PDSERVE_HOME", "/tmp/pdserve-home");
        jail.set_env("PDSERVE_LOG", "debug");
        jail.set_env("PDSERVE_PYTHON", "/usr/bin/python3");
        jail.set_env("PDSERVE_TRANSFER_PEER_SEED", "7");
        assert_eq!(
            ServeConfig::load(None, no_flags()).unwrap(),
            ServeConfig::default()
        );
        Ok(())
    });
}

#[test]
fn bad_value_types_rejected_from_every_layer() {
    Jail::expect_with(|jail| {
        // Flags layer.
        let err = ServeConfig::load(None, serde_json::json!({"model": {"tp": "two"}})).unwrap_err();
        assert_eq!(err.kind(), "config_invalid_value");
        let msg = err.to_string();
        assert!(
            msg.contains("model.tp") && msg.contains("command-line flags"),
            "{msg}"
        );

        // File layer.
        jail.create_file("pd.toml", "[server]\nport = \"eighty\"\n")?;
        let err = ServeConfig::load(Some(Path::new("pd.toml")), no_flags()).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("server.port") && msg.contains("pd.toml"),
            "{msg}"
        );

        // Environment layer: a bad enum variant and an out-of-range integer.
        jail.set_env("PDSERVE_INSTANCE__ROLE", "router");
        let err = ServeConfig::load(None, no_flags()).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("instance.role") && msg.contains("PDSERVE_INSTANCE__ROLE"),
            "{msg}"
        );
        jail.set_env("PDSERVE_INSTANCE__ROLE", "decode");
        jail.set_env("PDSERVE_SERVER__PORT", "70000");
        let err = ServeConfig::load(None, no_flags()).unwrap_err();
        assert!(err.to_string().contains("server.port"), "{err}");
        Ok(())
    });
}

/// `transfer.backend`, `transfer.mode` and `model.weights` are enums: a value outside
/// their names is refused when the layer is parsed, naming the key, the layer and the
/// accepted values.
#[test]
fn bad_enum_values_are_refused_at_parse_from_file_env_and_flags() {
    let cases = [
        ("transfer", "backend", "ucx", "local, shm, tcp, quic, rdma"),
        ("transfer", "mode", "both", "pull, push"),
        ("model", "weights", "q4", "auto, native, packed, q8_0, f32"),
    ];
    for (section, field, bad, accepted) in cases {
        let key = format!("{section}.{field}");
        let expect = |err: ConfigError, layer: &str| {
            assert_eq!(err.kind(), "config_invalid_value", "{key}: {err}");
            assert_eq!(err.key(), Some(key.as_str()), "{err}");
            let msg = err.to_string();
            assert!(
                msg.contains(&format!("{key} must be one of {accepted}, got `{bad}`")),
                "{msg}"
            );
            assert!(msg.contains(layer), "{layer}: {msg}");
        };
        Jail::expect_with(|jail| {
            jail.create_file("pd.toml", &format!("[{section}]\n{field} = \"{bad}\"\n"))?;
            let err = ServeConfig::load(Some(Path::new("pd.toml")), no_flags()).unwrap_err();
            expect(err, "pd.toml");

            jail.set_env(env_var_name(&key), bad);
            let err = ServeConfig::load(None, no_flags()).unwrap_err();
            expect(err, &env_var_name(&key));
            jail.clear_env();

            let flags = serde_json::json!({ section: { field: bad } });
            let err = ServeConfig::load(None, flags).unwrap_err();
            expect(err, "command-line flags");
            Ok(())
        });
    }
}

#[test]
fn enum_names_round_trip_and_every_spelling_in_use_still_parses() {
    fn round_trip<T>(all: &[T], names: &[&str])
    where
        T: Copy + PartialEq + fmt::Debug + fmt::Display + std::str::FromStr + Serialize,
        T: serde::de::DeserializeOwned,
        T::Err: fmt::Debug,
    {
        assert_eq!(all.len(), names.len());
        for (v, name) in all.iter().zip(names) {
            assert_eq!(v.to_string(), *name);
            assert_eq!(name.parse::<T>().unwrap(), *v);
            let json = serde_json::to_string(v).unwrap();
            assert_eq!(json, format!("\"{name}\""));
            assert_eq!(serde_json::from_str::<T>(&json).unwrap(), *v);
        }
    }
    round_trip(
        &TransferBackend::ALL,
        &["local", "shm", "tcp", "quic", "rdma"],
    );
    round_trip(&TransferMode::ALL, &["pull", "push"]);
    round_trip(
        &WeightFormat::ALL,
        &["auto", "native", "packed", "q8_0", "f32"],
    );
    // The older alias of `q8_0` (`pdserve run --weights q8`).
    assert_eq!("q8".parse::<WeightFormat>().unwrap(), WeightFormat::Q8_0);
    Jail::expect_with(|jail| {
        jail.create_file(
            "pd.toml",
            "[transfer]\nbackend = \"tcp\"\nmode = \"push\"\n[model]\nweights = \"native\"\n",
        )?;
        let c = ServeConfig::load(Some(Path::new("pd.toml")), no_flags()).unwrap();
        assert_eq!(c.transfer.backend, TransferBackend::Tcp);
        assert_eq!(c.transfer.mode, TransferMode::Push);
        assert_eq!(c.model.weights, WeightFormat::Native);
        jail.set_env("PDSERVE_TRANSFER__BACKEND", "quic");
        jail.set_env("PDSERVE_MODEL__WEIGHTS", "f32");
        let c = ServeConfig::load(Some(Path::new("pd.toml")), no_flags()).unwrap();
        assert_eq!(c.transfer.backend, TransferBackend::Quic);
        assert_eq!(c.model.weights, WeightFormat::F32);
        let flags = ServeFlags {
            transfer: Some("rdma".into()),
            transfer_mode: Some("pull".into()),
            weights: Some("q8_0".into()),
            ..ServeFlags::default()
        };
        let c = ServeConfig::load(Some(Path::new("pd.toml")), &flags).unwrap();
        assert_eq!(c.transfer.backend, TransferBackend::Rdma);
        assert_eq!(c.transfer.mode, TransferMode::Pull);
        assert_eq!(c.model.weights, WeightFormat::Q8_0);
        Ok(())
    });
}

#[test]
fn missing_config_file_is_an_error() {
    Jail::expect_with(|_| {
        let err = ServeConfig::load(Some(Path::new("nope.toml")), no_flags()).unwrap_err();
        assert_eq!(err.kind(), "config_file");
        assert!(err.to_string().contains("nope.toml"), "{err}");
        Ok(())
    });
}

#[test]
fn toml_syntax_error_is_reported() {
    Jail::expect_with(|jail| {
        jail.create_file("pd.toml", "[server\nport = 1\n")?;
        let err = ServeConfig::load(Some(Path::new("pd.toml")), no_flags()).unwrap_err();
        assert!(err.to_string().contains("pd.toml"), "{err}");
        Ok(())
    });
}

#[test]
fn validation_errors_name_the_key_and_layer() {
    Jail::expect_with(|jail| {
        jail.set_env("PDSERVE_SCHEDULER__BLOCK_SIZE", "24");
        let err = ServeConfig::load(None, no_flags()).unwrap_err();
        assert_eq!(err.kind(), "config_invalid");
        let msg = err.to_string();
        assert!(
            msg.contains("scheduler.block_size must be a power of two between 1 and 256"),
            "{msg}"
        );
        assert!(msg.contains("PDSERVE_SCHEDULER__BLOCK_SIZE"), "{msg}");
        Ok(())
    });
}

#[test]
fn validate_rejects_out_of_range_values() {
    type Mutation = fn(&mut ServeConfig);
    let cases: Vec<(&str, Mutation)> = vec![
        ("server.port must be > 0", |c| c.server.port = 0),
        ("multimodal.max_images_per_request must be 1..=64", |c| {
            c.multimodal.max_images_per_request = 0
        }),
        ("multimodal.max_image_bytes", |c| {
            c.multimodal.max_image_bytes = 1 << 30
        }),
        ("multimodal.encoder_cache_bytes", |c| {
            c.multimodal.encoder_cache_bytes = 1 << 40
        }),
        ("multimodal.max_image_width must be 1..=16384", |c| {
            c.multimodal.max_image_width = 0
        }),
        ("model.tp must be ≥ 1", |c| c.model.tp = 0),
        ("model.device", |c| c.model.device = "gpu".into()),
        ("model.device", |c| c.model.device = "cuda:".into()),
        ("model.dtype", |c| c.model.dtype = "f8".into()),
        ("a CPU format", |c| {
            c.model.device = "cuda".into();
            c.model.weights = WeightFormat::Q8_0;
        }),
        ("model.source", |c| c.model.source = "synthetic:".into()),
        ("scheduler.block_size", |c| c.scheduler.block_size = 512),
        ("scheduler.block_size", |c| c.scheduler.block_size = 0),
        ("scheduler.watermark", |c| c.scheduler.watermark = 0.5),
        ("scheduler.watermark", |c| c.scheduler.watermark = -0.1),
        ("scheduler.watermark", |c| c.scheduler.watermark = f64::NAN),
        ("scheduler.max_num_seqs", |c| c.scheduler.max_num_seqs = 0),
        ("scheduler.mailbox_capacity", |c| {
            c.scheduler.mailbox_capacity = 0
        }),
        ("scheduler.mailbox_capacity", |c| {
            c.scheduler.mailbox_capacity = (1 << 20) + 1
        }),
        ("scheduler.max_num_batched_tokens", |c| {
            c.scheduler.max_num_batched_tokens = 32
        }),
        ("scheduler.num_blocks", |c| c.scheduler.num_blocks = Some(0)),
        ("scheduler.kv_cache_bytes", |c| {
            c.scheduler.kv_cache_bytes = 0
        }),
        ("server.max_concurrent_requests", |c| {
            c.server.max_concurrent_requests = 0
        }),
        ("server.max_connections", |c| c.server.max_connections = 0),
        ("server.max_connections", |c| {
            c.server.max_connections = MAX_CONNECTIONS + 1
        }),
        ("server.header_read_timeout_s", |c| {
            c.server.header_read_timeout_s = 0
        }),
        ("instance.name", |c| c.instance.name = "a b".into()),
        ("logging.filter", |c| c.logging.filter = "info,[[[".into()),
        ("control.listen", |c| c.control.listen = "anywhere".into()),
        ("control.proxy", |c| {
            c.control.proxy = Some("proxy:7000".into())
        }),
        ("control.proxy", |c| {
            c.control.proxy = Some("127.0.0.1:0".into())
        }),
        ("control.heartbeat_ms", |c| c.control.heartbeat_ms = 0),
        ("control.heartbeat_ms", |c| c.control.heartbeat_ms = 600_000),
        ("server.tls_key is not", |c| {
            c.server.tls_cert = Some("cert.pem".into())
        }),
        ("server.tls_cert is not", |c| {
            c.server.tls_key = Some("key.pem".into())
        }),
        ("server.tls_ca must not be empty", |c| {
            c.server.tls_ca = Some(" ".into())
        }),
    ];
    for (needle, mutate) in cases {
        let mut c = ServeConfig::default();
        mutate(&mut c);
        let err = c.validate().expect_err(needle);
        assert!(err.to_string().contains(needle), "{needle}: {err}");
    }
    // Edges that are valid.
    let mut c = ServeConfig::default();
    c.scheduler.block_size = 256;
    c.scheduler.watermark = 0.0;
    c.scheduler.kv_cache_bytes = 0;
    c.scheduler.num_blocks = Some(1);
    c.validate().unwrap();
    c.scheduler.block_size = 1;
    c.validate().unwrap();
    // Port 0 with a proxy to register with (the bound address reaches it that way).
    c.server.port = 0;
    c.control.proxy = Some("127.0.0.1:9".into());
    c.validate().unwrap();
}

#[test]
fn served_model_names_layer_as_one_string_or_a_list() {
    Jail::expect_with(|jail| {
        jail.create_file("one.toml", "[model]\nname = \"gpt-x\"\n")?;
        let c = ServeConfig::load(Some(Path::new("one.toml")), no_flags()).unwrap();
        assert_eq!(c.model.name, ["gpt-x"]);
        jail.create_file("list.toml", "[model]\nname = [\"a\", \"b\"]\n")?;
        let path = Some(Path::new("list.toml"));
        let c = ServeConfig::load(path, no_flags()).unwrap();
        assert_eq!(c.model.name, ["a", "b"]);
        jail.set_env(env_var_name("model.name"), "[c, d, e]");
        let c = ServeConfig::load(path, no_flags()).unwrap();
        assert_eq!(c.model.name, ["c", "d", "e"]);
        let flags = ServeFlags {
            served_model_name: vec!["f".into()],
            ..ServeFlags::default()
        };
        let c = ServeConfig::load(path, &flags).unwrap();
        assert_eq!(c.model.name, ["f"]);
        jail.set_env(env_var_name("model.name"), "[c, c]");
        let err = ServeConfig::load(path, no_flags()).unwrap_err();
        assert_eq!(err.key(), Some("model.name"), "{err}");
        jail.set_env(env_var_name("model.name"), "\" \"");
        let err = ServeConfig::load(path, no_flags()).unwrap_err();
        assert_eq!(err.key(), Some("model.name"), "{err}");
        Ok(())
    });
    assert!(ServeConfig::default().model.name.is_empty());
}

#[test]
fn env_var_name_follows_the_rule() {
    assert_eq!(env_var_name("server.port"), "PDSERVE_SERVER__PORT");
    assert_eq!(
        env_var_name("scheduler.max_num_seqs"),
        "PDSERVE_SCHEDULER__MAX_NUM_SEQS"
    );
}

#[test]
fn every_config_key_is_settable_from_env() {
    // Walk the serialized default tree and set each key through its variable: catches a
    // field whose name would not survive the env mapping.
    let tree = serde_json::to_value(ServeConfig::default()).unwrap();
    let mut keys = Vec::new();
    for (section, fields) in tree.as_object().unwrap() {
        for field in fields.as_object().unwrap().keys() {
            keys.push(format!("{section}.{field}"));
        }
    }
    assert!(keys.len() >= 20, "{keys:?}");
    Jail::expect_with(|jail| {
        for key in &keys {
            jail.clear_env();
            let value = match key.as_str() {
                "model.source" => "synthetic:x",
                "model.name"
                | "server.api_key"
                | "server.host"
                | "instance.name"
                | "transfer.credentials_dir" => "abc",
                "transfer.backend" => "tcp",
                "transfer.mode" => "push",
                "transfer.min_remote_prompt_tokens" => "64",
                "transfer.advertise_addr" => "10.0.0.7",
                "transfer.io_threads" | "transfer.memcpy_threads" | "transfer.tcp_connections" => {
                    "8"
                }
                "transfer.piece_bytes" | "transfer.registration_chunk_bytes" => "8192",
                // The default is `true`: the variable must change it.
                "transfer.require_auth" | "scheduler.prefix_cache" | "kv_tiers.stream_layers" => {
                    "false"
                }
                "transfer.tcp_integrity" => "mac",
                "kv_tiers.enabled" => "true",
                "kv_tiers.write_policy" => "selective",
                "kv_tiers.disk_dir" => "abc",
                "kv_tiers.shared_dir" => "def",
                "kv_tiers.shared_url" => "redis://127.0.0.1:6379/1",
                "transfer.rdma_devices" => "mlx5_0,mlx5_1",
                "transfer.rdma_port" => "2",
                "transfer.rdma_send_queue_depth" => "256",
                "transfer.listen" | "control.listen" | "control.proxy" => "127.0.0.1:9999",
                // A table: one of its keys, as figment reads a dict from the environment
                // (kind stays `static`, which needs no credentials).
                "control.discovery" => "{lease_ttl_s=30}",
                "model.weights" => "q8_0",
                "scheduler.kv_cache_dtype" => "f16",
                "model.device" => "cuda:1",
                "model.dtype" => "bf16",
                "instance.role" => "prefill",
                "logging.filter" => "warn",
                "logging.format" => "json",
                "faults.actor_panic_target" => "KvSender",
                "scheduler.watermark" => "0.2",
                k if k.starts_with("faults.")
                    && !k.ends_with("_ms")
                    && !k.ends_with("_max")
                    && k != "faults.seed" =>
                {
                    "0.5"
                }
                "scheduler.block_size"
                | "scheduler.max_num_seqs"
                | "multimodal.max_images_per_request" => "32",
                "server.port" | "scheduler.num_blocks" | "scheduler.max_model_len" => "4096",
                _ => "2048",
            };
            jail.set_env(env_var_name(key), value);
            // HTTPS takes a certificate and its key together.
            let partner = match key.as_str() {
                "server.tls_cert" => Some("server.tls_key"),
                "server.tls_key" => Some("server.tls_cert"),
                _ => None,
            };
            if let Some(partner) = partner {
                jail.set_env(env_var_name(partner), "other.pem");
            }
            let c = ServeConfig::load(None, no_flags()).unwrap_or_else(|e| panic!("{key}: {e}"));
            let got = serde_json::to_value(&c).unwrap();
            let (section, field) = key.split_once('.').unwrap();
            let before = &tree[section][field];
            assert_ne!(&got[section][field], before, "{key} not applied from env");
        }
        Ok(())
    });
}

#[test]
fn numeric_looking_strings_from_env_stay_strings() {
    Jail::expect_with(|jail| {
        jail.set_env("PDSERVE_SERVER__API_KEY", "12345");
        jail.set_env("PDSERVE_INSTANCE__NAME", "7");
        let c = ServeConfig::load(None, no_flags()).unwrap();
        assert_eq!(c.server.api_key.as_deref(), Some("12345"));
        assert_eq!(c.instance.name, "7");
        Ok(())
    });
}

#[test]
fn the_proxy_config_layers_file_env_and_flags_and_ignores_instance_sections() {
    figment::Jail::expect_with(|jail| {
        jail.create_file(
            "proxy.toml",
            "[proxy]\nport = 9100\ndecode = [\"http://10.0.0.3:8200\"]\ntimeout_s = 30\n",
        )?;
        jail.set_env("PDSERVE_PROXY__TIMEOUT_S", "45");
        // An instance's variable in the same environment is not the proxy's business.
        jail.set_env("PDSERVE_SERVER__PORT", "9002");
        #[derive(Serialize)]
        struct Flags {
            proxy: Partial,
        }
        #[derive(Serialize)]
        struct Partial {
            max_prefill_queue: usize,
        }
        let c = ProxyConfig::load(
            Some(Path::new("proxy.toml")),
            Flags {
                proxy: Partial {
                    max_prefill_queue: 3,
                },
            },
        )
        .unwrap();
        assert_eq!(c.proxy.port, 9100, "file");
        assert_eq!(c.proxy.decode, vec!["http://10.0.0.3:8200".to_string()]);
        assert_eq!(c.proxy.timeout_s, 45, "env over file");
        assert_eq!(c.proxy.max_prefill_queue, Some(3), "flags");
        assert_eq!(c.proxy.node, "proxy", "default");
        // HTTPS: a certificate from the environment without its key is refused.
        let no_flags = serde_json::json!({});
        jail.set_env("PDSERVE_PROXY__TLS_CERT", "proxy.pem");
        let e = ProxyConfig::load(None, &no_flags).unwrap_err().to_string();
        assert!(e.contains("proxy.tls_key is not"), "{e}");
        jail.set_env("PDSERVE_PROXY__TLS_KEY", "proxy.key");
        let c = ProxyConfig::load(None, &no_flags).unwrap();
        assert_eq!(c.proxy.tls_key.as_deref(), Some("proxy.key"));
        jail.set_env("PDSERVE_PROXY__TIMEOUT", "45");
        let e = ProxyConfig::load(None, ProxyConfig::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("PDSERVE_PROXY__TIMEOUT"), "{e}");
        Ok(())
    });
}

#[test]
fn the_proxy_router_settings_parse_and_bad_ones_are_named() {
    // In a jail: the loader reads PDSERVE_PROXY__* variables other tests set.
    figment::Jail::expect_with(|_jail| {
        let load = |flags: serde_json::Value| ProxyConfig::load(None, flags);
        let c = load(serde_json::json!({})).unwrap();
        assert_eq!(c.proxy.router, RouterKind::Kv, "kv is the default");
        assert_eq!(c.proxy.kv_tier_credit, TierCredit::default());
        let c = load(serde_json::json!({"proxy": {"kv_tier_credit": {"host": 0.9}}})).unwrap();
        assert_eq!(
            (c.proxy.kv_tier_credit.host, c.proxy.kv_tier_credit.disk),
            (0.9, 0.5),
            "unset tiers keep their default"
        );
        let c = load(
            serde_json::json!({"proxy": {"router": "round-robin", "prefill_load_scale": 2.5}}),
        )
        .unwrap();
        assert_eq!(
            (c.proxy.router, c.proxy.prefill_load_scale),
            (RouterKind::RoundRobin, 2.5)
        );
        assert_eq!(
            "least-loaded".parse::<RouterKind>().unwrap().as_str(),
            "least-loaded"
        );
        let e = "random".parse::<RouterKind>().unwrap_err();
        assert_eq!((e.key, e.value.as_str()), ("proxy.router", "random"));
        assert!(
            e.to_string().contains("kv, least-loaded, round-robin"),
            "{e}"
        );
        for name in RouterKind::NAMES {
            assert_eq!(name.parse::<RouterKind>().unwrap().as_str(), *name);
        }
        let e = load(serde_json::json!({"proxy": {"router": "random"}}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("random"), "{e}");
        for (key, bad) in [
            ("prefill_load_scale", serde_json::json!(-1.0)),
            ("kv_index_max_blocks", serde_json::json!(0)),
            ("kv_tier_credit", serde_json::json!({"disk": 1.5})),
            ("max_concurrent_requests", serde_json::json!(0)),
            ("max_connections", serde_json::json!(0)),
            ("header_read_timeout_s", serde_json::json!(0)),
        ] {
            let e = load(serde_json::json!({"proxy": {key: bad}}))
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("proxy.{key}")), "{key}: {e}");
        }
        Ok(())
    });
}

#[test]
fn an_etcd_proxy_bound_to_every_interface_needs_an_address_to_publish() {
    // In a jail: the loader reads PDSERVE_PROXY__* variables other tests set.
    figment::Jail::expect_with(|jail| {
        let load = || ProxyConfig::load(None, serde_json::json!({}));
        jail.set_env("PDSERVE_PROXY__CREDENTIALS_DIR", "/etc/pdserve/cluster");
        jail.set_env("PDSERVE_PROXY__DISCOVERY__KIND", "etcd");
        jail.set_env(
            "PDSERVE_PROXY__DISCOVERY__ETCD_ENDPOINTS",
            "[http://etcd:2379]",
        );
        // A specific control address is published as it is.
        jail.set_env("PDSERVE_PROXY__CONTROL_LISTEN", "10.0.0.1:7000");
        assert_eq!(load().unwrap().proxy.advertise_addr, None);
        // 0.0.0.0 would be published as is, and every instance would connect to itself.
        jail.set_env("PDSERVE_PROXY__CONTROL_LISTEN", "0.0.0.0:7000");
        let e = load().unwrap_err().to_string();
        assert!(e.contains("proxy.advertise_addr"), "{e}");
        assert!(e.contains("pod IP"), "{e}");
        // Without etcd nothing is published: binding every interface needs no address.
        jail.set_env("PDSERVE_PROXY__DISCOVERY__KIND", "static");
        load().unwrap();
        jail.set_env("PDSERVE_PROXY__DISCOVERY__KIND", "etcd");
        jail.set_env("PDSERVE_PROXY__ADVERTISE_ADDR", "10.244.1.7");
        let c = load().unwrap();
        assert_eq!(c.proxy.advertise_addr.as_deref(), Some("10.244.1.7"));
        for bad in ["0.0.0.0", "::", "proxy-0", "10.244.1.7:7000"] {
            jail.set_env("PDSERVE_PROXY__ADVERTISE_ADDR", bad);
            let e = load().unwrap_err().to_string();
            assert!(e.contains("proxy.advertise_addr"), "{bad}: {e}");
        }
        Ok(())
    });
}

#[test]
fn kv_tiers_need_a_place_to_spill_to_and_the_prefix_cache() {
    let mut c = ServeConfig::default();
    c.kv_tiers.enabled = true;
    c.validate().unwrap();
    c.kv_tiers.host_capacity_bytes = 0;
    let e = c.validate().unwrap_err().to_string();
    assert!(e.contains("kv_tiers.enabled"), "{e}");
    c.kv_tiers.disk_dir = Some("/var/cache/pdserve".into());
    c.validate().unwrap();
    c.kv_tiers.disk_capacity_bytes = 0;
    let e = c.validate().unwrap_err().to_string();
    assert!(e.contains("kv_tiers.disk_capacity_bytes"), "{e}");
    c.kv_tiers.disk_capacity_bytes = 1 << 30;
    c.scheduler.prefix_cache = false;
    let e = c.validate().unwrap_err().to_string();
    assert!(e.contains("prefix_cache"), "{e}");
    c.scheduler.prefix_cache = true;
    c.kv_tiers.selective_min_hits = 0;
    let e = c.validate().unwrap_err().to_string();
    assert!(e.contains("kv_tiers.selective_min_hits"), "{e}");
    c.kv_tiers.selective_min_hits = 2;
    // A shared store alone is a place to spill to; it needs a capacity and its own directory.
    c.kv_tiers.disk_dir = None;
    c.kv_tiers.shared_dir = Some("/mnt/kv-shared".into());
    c.validate().unwrap();
    c.kv_tiers.shared_capacity_bytes = 0;
    let e = c.validate().unwrap_err().to_string();
    assert!(e.contains("kv_tiers.shared_capacity_bytes"), "{e}");
    c.kv_tiers.shared_capacity_bytes = 1 << 30;
    c.kv_tiers.disk_dir = Some("/mnt/kv-shared".into());
    let e = c.validate().unwrap_err().to_string();
    assert!(e.contains("kv_tiers.shared_dir must differ"), "{e}");
    // Or on Redis: one shared store at a time, named by a redis URL.
    c.kv_tiers.disk_dir = None;
    c.kv_tiers.shared_url = Some("redis://127.0.0.1:6379/0".into());
    let e = c.validate().unwrap_err().to_string();
    assert!(e.contains("set one"), "{e}");
    c.kv_tiers.shared_dir = None;
    c.validate().unwrap();
    c.kv_tiers.shared_url = Some("http://127.0.0.1:6379".into());
    let e = c.validate().unwrap_err().to_string();
    assert!(e.contains("kv_tiers.shared_url must be redis://"), "{e}");
}

/// `model.mmproj` and the E/P/D keys: from the file, the flag beats it; the role `encode`
/// parses; `multimodal.encoder_hold_slots` is bounded by name.
#[test]
fn encoder_keys_parse_and_are_bounded() {
    Jail::expect_with(|jail| {
        jail.create_file(
            "e.toml",
            "[model]\nmmproj = \"/m/mmproj.gguf\"\n[instance]\nrole = \"encode\"\n[multimodal]\nencoder_hold_slots = 8\n",
        )?;
        let path = Path::new("e.toml");
        let c = ServeConfig::load(Some(path), no_flags()).unwrap();
        assert_eq!(c.model.mmproj.as_deref(), Some("/m/mmproj.gguf"));
        assert_eq!(c.instance.role, Role::Encode);
        assert_eq!(c.multimodal.encoder_hold_slots, 8);
        let flags = ServeFlags {
            mmproj: Some("other.gguf".into()),
            ..Default::default()
        };
        let c = ServeConfig::load(Some(path), &flags).unwrap();
        assert_eq!(c.model.mmproj.as_deref(), Some("other.gguf"));
        jail.create_file("bad.toml", "[multimodal]\nencoder_hold_slots = 0\n")?;
        let err = ServeConfig::load(Some(Path::new("bad.toml")), no_flags())
            .unwrap_err()
            .to_string();
        assert!(err.contains("multimodal.encoder_hold_slots"), "{err}");
        Ok(())
    });
}
